"""Data-parallel PTQ calibration under torchrun (or any initialized ``torch.distributed`` process group).

``quantize_model`` inside a process group of W > 1 ranks (``data_parallel=None``, the default, or True):

- Split: every rank passes the same calibration ids and holds the same model (checked before any layer
  runs: fingerprints of the ids and of the model, ``model_fingerprint``, are compared across ranks); the
  ids are cut into calibration batches of ``batch_size`` rows as in one process, and rank r takes the
  contiguous block of batches ``[floor(r B / W), floor((r + 1) B / W))`` of the B batches (``shard``).
  The union in rank order is the single-process set, and every rank runs exactly the single-process
  batches (same rows, same shapes), so per batch its activations are the single-process ones. A rank may
  get no batch (B < W); it still takes part in every reduction.
- Statistics (``reduce_statistics``), after each recording and before anything reads them: token counts
  and routed-token counts summed; input amax and per-channel max |x| (SmoothQuant) the max (exact);
  AWQ's sampled rows all-gathered and concatenated in rank order (each rank samples every k-th row of each
  of its batches with the global k, so the set and its order are the single-process ones: exact);
  per-channel sums of x^2 (Hessian-aware scales) gathered and added in float64 in rank order; the
  Hessians: each rank's running mean ``H_r`` over its ``n_r`` tokens is all-gathered and every rank forms
  ``H = (sum_r n_r H_r) / N`` in float64, adding in rank order (``n_r H_r = 2 sum x x^T`` of rank r, the
  un-normalised sum), then rounds it to the accumulator's dtype. Every rank computes the same bits; they
  are NOT the single-process bits in general (one process folds the batches into one FP32 running mean
  in batch order, so the rounding differs: relative differences ~1e-7 to 1e-6 of the entries). Fused 3-D
  experts (``ExpertStatistics``): each expert's and projection's statistics the same way.
- KV cache (``kv_amax``): the K / V amaxes the max over ranks (exact).
- Solves (``solver``): a method whose ``quantize_weight`` reads the statistics (GPTQ) solves the layer's
  j-th weight (in quantize order: fused groups as ``quantize_model`` walks them, then every fused-experts
  module's experts e = 0.. and projections gate_up, down) on rank ``j % W`` only; the results (codes,
  scales, outer scale / amax of each ``QuantizedTensor``, and the note) are all-gathered, so every rank
  builds the same modules from the same tensors. RTN / AWQ / SmoothQuant round on every rank (cheap and
  deterministic, so identical).
- Errors: ``synced`` runs a step and compares outcomes over ranks; when any rank failed, every rank
  raises (the failing rank its own error, the others the same class with ``rank r: <message>`` of the
  lowest failing rank), each marked ``synced``: a command line prints that first failure once, on rank 0,
  and a failing rank whose own message differs prints its own line too (``printed_by_rank0``). A process
  that failed before entering any sync point joins the next one from its error handler (``agree``: the
  first sync point of ``quantize_model`` is its preflight), so an error of one rank alone before
  calibration (a missing file, a model that does not load) stops every rank there. A collective that fails
  (a peer process ended or left the group) raises ``RanksLost`` naming the step.

Without a process group (or W = 1, or ``data_parallel=False``) every function here is the identity and
``quantize_model`` runs exactly as before.
"""
from __future__ import annotations

import builtins
import io
import json
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import errors as _errors
from ..errors import BlockscaleError, UsageError
from ..nn.fused import fused_groups
from ..nn.experts_layouts import experts_layout_of
from .fused_experts import _outer_scales, expert_scale_groups
from .protocol import QuantizedWeight, SolvedMethod
from .scheme_quantize import group_weight_scale

_SYNCED = "blockscale_synced"  # attribute set on an exception every rank raised together
_OWN_LINE = "blockscale_own_line"  # ... and on a rank whose own message differs from the first failure's
_ENTERED = [0]  # synchronisation points this process has entered (any quantize_model call)
_CHUNK = 1 << 26  # bytes of a tensor hashed at a time (model_fingerprint)


class RanksLost(BlockscaleError):
    """A collective of data-parallel calibration failed: another rank ended (or left the group) while this
    one waited for it. That rank's own error line says why."""


def printed_by_rank0(exc: BaseException) -> bool:
    """Whether a command line on a rank other than 0 should stay silent about ``exc``: every rank raised it
    together at a synchronisation point and rank 0 prints it (the first failure). False: a failure of this
    rank alone, or its own message differs from the one rank 0 prints."""
    return bool(getattr(exc, _SYNCED, False)) and not getattr(exc, _OWN_LINE, False)


def raised_together(exc: BaseException) -> bool:
    """Whether every rank raised ``exc`` (or its counterpart) at the same synchronisation point."""
    return bool(getattr(exc, _SYNCED, False))


def sync_points() -> int:
    """Synchronisation points this process has entered so far."""
    return _ENTERED[0]


def _raise(exc: BaseException):
    raise exc


def agree(exc: Optional[BaseException] = None) -> None:
    """Join the next synchronisation point of the other ranks of the default process group with this
    process's outcome (``exc``, or None: success) and raise what ``synced`` raises there: ``exc`` itself
    when no rank but this one failed. For a process that ended (failed, or returned without entering any
    sync point) while the others may still be on their way to their first one."""
    ranks = CalibrationRanks(dist.get_rank(), dist.get_world_size())
    ranks.synced(_raise, exc) if exc is not None else ranks.synced(lambda: None)


def after_report() -> None:
    """Every rank, after an error raised together (``raised_together``) was printed: the other ranks wait
    here until rank 0 has printed (so torchrun, ending the job when the first rank exits, cannot end rank 0
    before its line is out)."""
    CalibrationRanks(dist.get_rank(), dist.get_world_size())._gather(torch.zeros(1), "the final handshake")


def _collective(what: str, op: Callable, *args) -> None:
    """``op(*args)``, a collective; its failure (a peer process ended: gloo's "Connection closed by peer",
    a timeout) is a ``RanksLost`` naming ``what``."""
    try:
        op(*args)
    except RuntimeError as exc:
        text = " ".join(str(exc).split())
        if text.startswith("["):  # gloo's "[path/file.cc:line] " prefix
            text = text.split("] ", 1)[-1]
        text = text.split(". ", 1)[0].rstrip(".")
        raise RanksLost(f"data-parallel calibration: {what} across ranks failed ({text}); another rank "
                        "probably failed or was ended, and its own error line says why") from exc


def _plain(value):
    """``value`` as plain JSON data (the form in which configs are compared)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _crc(t: torch.Tensor) -> Optional[int]:
    """CRC-32 of the bytes of ``t`` (None on the meta device), read ``_CHUNK`` bytes at a time."""
    if t.device.type == "meta":
        return None
    flat = t.detach().reshape(-1)
    step = max(1, _CHUNK // max(1, t.element_size()))
    crc = 0
    for i in range(0, flat.numel(), step):
        crc = zlib.crc32(flat[i:i + step].to("cpu").contiguous().view(torch.uint8).numpy(), crc)
    return crc


def model_fingerprint(model: torch.nn.Module) -> dict:
    """What must be the same on every rank: the model's config (``model.config.to_dict()`` without private
    keys such as ``_name_or_path`` and without ``transformers_version``), the name, shape and dtype of every
    parameter and buffer, and a CRC-32 of every parameter's full bytes (buffers, computed at load, are
    compared by shape and dtype only). Costs one pass over the weights (about 3 GB/s of CPU)."""
    cfg = getattr(model, "config", None)
    conf = None
    if cfg is not None and callable(getattr(cfg, "to_dict", None)):
        conf = _plain({k: v for k, v in cfg.to_dict().items()
                       if not str(k).startswith("_") and k != "transformers_version"})
    params = [(n, tuple(p.shape), str(p.dtype), _crc(p)) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return {"config": conf, "parameters": params, "buffers": buffers}


def model_difference(a: dict, b: dict, names=("rank 0", "rank 1")) -> Optional[str]:
    """The first difference of model fingerprint ``b`` from ``a`` in words (``names``: whose they are), or
    None: config fields, then the parameters' and buffers' names, shapes and dtypes, then the weights."""
    ca, cb = a["config"] or {}, b["config"] or {}
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            return f"config {k}: {ca.get(k)!r} vs {cb.get(k)!r}"
    for kind in ("parameters", "buffers"):
        la, lb = {e[0]: e for e in a[kind]}, {e[0]: e for e in b[kind]}
        only = [(n, names[0]) for n in la if n not in lb] + [(n, names[1]) for n in lb if n not in la]
        if only:
            return f"{kind[:-1]} {only[0][0]} only on {only[0][1]}"
        for name, ea in la.items():
            eb = lb[name]
            if ea[1:3] != eb[1:3]:
                return f"{name}: {list(ea[1])} {ea[2]} vs {list(eb[1])} {eb[2]}"
    crc_b = {e[0]: e[3] for e in b["parameters"]}
    for name, _, _, crc in a["parameters"]:
        if crc != crc_b[name]:
            return f"the weights of {name} differ"
    return None


def _peer_error(name: str, message: str) -> Exception:
    """Another rank's error: its class (blockscale's or a builtin, e.g. FileNotFoundError, so the command line
    reports it alike), else RuntimeError, with ``message``."""
    cls = getattr(_errors, name, None) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 -- a class that needs other arguments
            pass
    return RuntimeError(message)


@dataclass(frozen=True)
class CalibrationRanks:
    """This process's place in data-parallel calibration (``rank`` of ``world``); ``world == 1``: not
    distributed, every method is the identity."""

    rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ collectives
    def _comm_device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather(self, t: torch.Tensor, what: str = "gathering statistics") -> list[torch.Tensor]:
        dev = self._comm_device()
        x = t.detach().to(dev).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        _collective(what, dist.all_gather, out, x)
        return out

    def _gather_objects(self, obj, what: str = "exchanging results") -> list:
        """``obj`` of every rank, in rank order. Tensors inside travel as ``torch.save`` bytes (the pickling of
        ``all_gather_object`` does not carry every dtype, e.g. float8); the peers are this job's own ranks."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        out = [None] * self.world
        _collective(what, dist.all_gather_object, out, buf.getvalue())
        return [torch.load(io.BytesIO(b), weights_only=False) for b in out]

    def synced(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on every rank, then a comparison of the outcomes: when any rank raised, every
        rank raises (see the module docstring). The identity when not distributed."""
        if not self.enabled:
            return fn(*args, **kwargs)
        err = None
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- every failure is passed to the other ranks
            err = exc
        _ENTERED[0] += 1
        seen = self._gather_objects(None if err is None else (type(err).__name__, str(err)), "agreeing on errors")
        failed = [(r, e) for r, e in enumerate(seen) if e is not None]
        if not failed:
            return out
        first, (name, msg) = failed[0]
        if err is None:
            err = _peer_error(name, f"rank {first}: {msg}")
        elif str(err) != msg:  # this rank's own, other error: it prints it itself
            setattr(err, _OWN_LINE, True)
        setattr(err, _SYNCED, True)
        raise err

    # ------------------------------------------------------------------ calibration rows
    def shard(self, batches: list[torch.Tensor], calibration: torch.Tensor,
              model: Optional[torch.nn.Module] = None) -> list[torch.Tensor]:
        """This rank's contiguous block of the calibration ``batches`` (a UsageError on every rank when the
        ranks hold different models, ``model_fingerprint``, or were given different calibration ids)."""
        if not self.enabled:
            return batches

        def check():
            ids = calibration.detach().reshape(-1).to(torch.int64).cpu()
            w = torch.arange(1, ids.numel() + 1, dtype=torch.int64) % 1000003
            mine = (tuple(calibration.shape), int((ids * w).sum()), int(ids.sum()))
            held = model_fingerprint(model) if model is not None else None
            got = self._gather_objects((mine, held), "comparing the models and calibration ids")
            models = [g[1] for g in got]
            for r, other in enumerate(models):
                what = model_difference(models[0], other, ("rank 0", f"rank {r}")) \
                    if models[0] is not None and other is not None else None
                if what is not None:
                    raise UsageError(f"model: rank {r} holds another model than rank 0 ({what}); under data-parallel "
                                     "calibration every rank loads the same model (same config and weights)")
            prints = [g[0] for g in got]
            bad = next((r for r, p in enumerate(prints) if p != prints[0]), None)
            if bad is not None:
                raise UsageError(f"calibration: rank {bad} was given other calibration ids than rank 0 (shape "
                                 f"{prints[bad][0]} vs {prints[0][0]}); under data-parallel calibration every rank "
                                 "passes the same ids and takes its share itself (or use data_parallel=False)")

        self.synced(check)
        B = len(batches)
        return batches[self.rank * B // self.world:(self.rank + 1) * B // self.world]

    # ------------------------------------------------------------------ statistics
    def statistics(self, record: Callable[[], tuple], device=None) -> tuple:
        """``record()`` (-> (Linear statistics, fused-experts statistics)) on this rank's share, its errors
        synchronised, then reduced over ranks (``reduce_statistics``; gathered samples land on ``device``)."""
        if not self.enabled:
            return record()
        stats, ex = self.synced(record)
        return self.reduce_statistics(stats, ex, device)

    def reduce_statistics(self, stats: Optional[dict], ex_stats: Optional[dict], device=None) -> tuple:
        """Reduce, in place, name -> ``InputStatistics`` and name -> ``ExpertStatistics`` over ranks (the
        module docstring says how each field is reduced; gathered AWQ samples are put on ``device``, default
        the CPU). Returns them."""
        if not self.enabled:
            return stats, ex_stats
        every = list((stats or {}).values())
        experts = list((ex_stats or {}).values())
        for est in experts:
            every += [st for p in est.stats for st in est.stats[p]]
        routed = [c for est in experts for c in est.routed]
        # tokens (sum), amax (max), routed counts (sum): exact in float64 (integers < 2^53, FP32 maxima)
        scal = torch.tensor([[float(st.tokens), float(st.amax)] for st in every] + [[float(c), 0.0] for c in routed],
                            dtype=torch.float64).reshape(-1, 2)
        parts = self._gather(scal)
        tokens = torch.stack([p[:, 0] for p in parts]).sum(0)
        amax = torch.stack([p[:, 1] for p in parts]).amax(0)
        for i, st in enumerate(every):
            st.tokens, st.amax = int(tokens[i]), float(amax[i])
        i = len(every)
        for est in experts:
            for e in range(len(est.routed)):
                est.routed[e] = int(tokens[i])
                i += 1
        with_abs = [st for st in every if st.absmax is not None]
        if with_abs:  # per-channel max |x|: max (exact, order-free)
            flat = torch.cat([st.absmax.reshape(-1).float() for st in with_abs]).to(self._comm_device())
            _collective("reducing statistics", dist.all_reduce, flat, dist.ReduceOp.MAX)
            at = 0
            for st in with_abs:
                k = st.absmax.numel()
                st.absmax = flat[at:at + k].to(st.absmax.device).reshape(st.absmax.shape)
                at += k
        with_sq = [st for st in every if getattr(st, "sqsum", None) is not None]
        if with_sq:  # per-channel sums of x^2 (Hessian-aware scales): float64, added in rank order
            mats = self._gather(torch.cat([st.sqsum.reshape(-1) for st in with_sq]))
            total = mats[0].double().clone()
            for m in mats[1:]:
                total += m.double()
            at = 0
            for st in with_sq:
                k = st.sqsum.numel()
                st.sqsum = total[at:at + k].to(st.sqsum.device).reshape(st.sqsum.shape)
                at += k
        sampled = [st for st in every if st.sample_every]
        if sampled:  # AWQ's rows: concatenated in rank order
            mine = [[s.cpu() for s in st.samples] for st in sampled]
            got = self._gather_objects(mine)
            dev = torch.device("cpu") if device is None else torch.device(device)
            for j, st in enumerate(sampled):
                st.samples = [s.to(dev) for r in range(self.world) for s in got[r][j]]
        for i, st in enumerate(every):  # Hessians: (sum_r n_r H_r) / N in float64, added in rank order
            acc = st.hessian
            if acc is None:
                continue
            counts = [int(p[i, 0]) for p in parts]
            mats = self._gather(acc.H)
            total = torch.zeros(acc.H.shape, dtype=torch.float64, device=mats[0].device)
            for c, m in zip(counts, mats):
                if c:
                    total += m.double() * c
            N = sum(counts)
            acc._H = (total / N if N else total).to(device=acc.H.device, dtype=acc.H.dtype)
            acc.n_tokens = N
        return stats, ex_stats

    def kv_amax(self, amax: dict, names) -> dict:
        """{attention name: (k_amax, v_amax)} of this rank's share -> the max over ranks (exact), for every
        name of ``names`` some rank saw."""
        if not self.enabled:
            return amax
        got = self._gather_objects({n: (k.cpu(), v.cpu()) for n, (k, v) in amax.items()})
        out = {}
        for n in names:
            seen = [g[n] for g in got if n in g]
            if not seen:
                continue
            k, v = seen[0]
            for k2, v2 in seen[1:]:
                k, v = torch.maximum(k, k2), torch.maximum(v, v2)
            dev = amax[n][0].device if n in amax else k.device
            out[n] = (k.to(dev), v.to(dev))
        return out

    # ------------------------------------------------------------------ solves
    def solver(self, method, model, linears: dict, experts: dict, stats: Optional[dict], ex_stats: Optional[dict],
               schemes: dict, outer_scale: str = "expert", latent: bool = False):
        """``method``, or (distributed, and the method's ``quantize_weight`` reads statistics) a stand-in whose
        ``quantize_weight`` returns the results solved over ranks: weight j on rank ``j % world``, all
        gathered (with ``latent``, each result's ``QuantizedWeight.latent`` too: scale learning's latent weights,
        e.g. GPTQ's). A weight whose solve raised is left out, so ``quantize_model`` solves it (and raises) on
        every rank itself."""
        if not self.enabled or not method.quantizes_with_statistics or (stats is None and ex_stats is None):
            return method
        try:
            jobs = _jobs(model, linears, experts, stats, ex_stats, schemes, outer_scale)
        except Exception:  # noqa: BLE001 -- every rank solves locally (and raises the same error) instead
            return method
        mine = {}
        for j, (key, w, st, spec, S) in enumerate(jobs):
            if j % self.world != self.rank:
                continue
            try:
                res = method.quantize_weight(w, st, spec, S)
            except Exception:  # noqa: BLE001 -- solved again (and raised) on every rank by quantize_model
                continue
            kept = res.latent.to("cpu") if latent and res.latent is not None else None
            mine[key] = (res.q.to("cpu"), res.note, kept)
        results = {}
        for got in self._gather_objects(mine):
            results.update(got)
        devices = {key: w.device for key, w, *_ in jobs}
        return SolvedMethod(method, {k: QuantizedWeight(q.to(devices[k]), note, None if lw is None else lw.to(devices[k]))
                                     for k, (q, note, lw) in results.items()})


def _jobs(model, linears, experts, stats, ex_stats, schemes, outer_scale) -> list[tuple]:
    """(statistics name, weight, statistics, weight spec, shared scale) of every ``quantize_weight`` call
    ``quantize_model`` makes for this layer, in its order (the scales as it computes them)."""
    jobs = []
    if stats is not None and linears:
        groups = fused_groups(list(linears))
        scale_group = {n: g for g in expert_scale_groups(groups, outer_scale, schemes) for n in g}
        for group in groups:
            scheme = schemes[group[0]]
            try:
                S = group_weight_scale(scheme, [linears[n].weight for n in scale_group[group[0]]])
            except ValueError:
                continue  # quantize_model raises it
            for n in group:
                if n in stats:
                    jobs.append((stats[n].name, linears[n].weight.detach(), stats[n], scheme.weight_spec, S))
    for name, module in (experts or {}).items():
        est = ex_stats.get(name) if ex_stats else None
        if est is None:
            continue
        scheme = schemes[name]
        W_gu, W_dn = experts_layout_of(module).matrices(module)
        try:
            S_all = _outer_scales(scheme, W_gu, W_dn, outer_scale)
        except ValueError:
            continue
        for e in range(W_gu.shape[0]):
            for p, w in (("gate_up", W_gu[e]), ("down", W_dn[e])):
                st = est.stats[p][e]
                jobs.append((st.name, w, st, scheme.weight_spec, S_all[p][e]))
    return jobs


def calibration_ranks(data_parallel: Optional[bool] = None) -> CalibrationRanks:
    """The data-parallel calibration of this process: ``None``: on when a ``torch.distributed`` process group
    of more than one rank is initialized; True: on (a UsageError without a process group); False: off."""
    if data_parallel is not None and not isinstance(data_parallel, bool):
        raise UsageError(f"data_parallel={data_parallel!r}; allowed values: None (auto), True, False")
    ready = dist.is_available() and dist.is_initialized()
    if data_parallel and not ready:
        raise UsageError("data_parallel=True needs an initialized torch.distributed process group (run under "
                         "torchrun, or call torch.distributed.init_process_group first)")
    if data_parallel is False or not ready or dist.get_world_size() == 1:
        return CalibrationRanks()
    return CalibrationRanks(dist.get_rank(), dist.get_world_size())


__all__ = ["CalibrationRanks", "RanksLost", "after_report", "agree", "calibration_ranks", "model_difference",
           "model_fingerprint", "printed_by_rank0", "raised_together", "sync_points"]
