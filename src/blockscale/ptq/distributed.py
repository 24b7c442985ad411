"""Data-parallel PTQ calibration under torchrun (or any initialized ``torch.distributed`` process group).

``quantize_model`` inside a process group of W > 1 ranks (``data_parallel=None``, the default, or True):

- Split: every rank passes the same calibration ids (checked: a fingerprint of the ids is compared across
  ranks); they are cut into calibration batches of ``batch_size`` rows as in one process, and rank r takes
  the contiguous block of batches ``[floor(r B / W), floor((r + 1) B / W))`` of the B batches (``shard``).
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
  raises (the failing rank its own error, the others the same class with ``rank r: <message>``), each
  marked ``synced`` so a command line prints it once, on rank 0 (``printed_by_rank0``).

Without a process group (or W = 1, or ``data_parallel=False``) every function here is the identity and
``quantize_model`` runs exactly as before.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import errors as _errors
from ..errors import UsageError
from ..nn.fused import fused_groups
from ..nn.nvfp4_gpt_oss_experts import gpt_oss_expert_matrices, is_gpt_oss_experts
from .fused_experts import _outer_scales, expert_scale_groups
from .protocol import QuantizedWeight
from .scheme_quantize import group_weight_scale

_SYNCED = "blockscale_synced"  # attribute set on an exception every rank raised together
_PASSED = [0]  # synchronisation points this process has passed (any quantize_model call)


def printed_by_rank0(exc: BaseException) -> bool:
    """Whether a command line on a rank other than 0 should stay silent about ``exc``: every rank raised it
    together at a synchronisation point (rank 0 prints it), or it came before the first one (flags, files,
    the model: the same on every rank, so rank 0 prints it too). False: a failure of this rank alone."""
    return bool(getattr(exc, _SYNCED, False)) or _PASSED[0] == 0


def _error_class(name: str) -> type:
    cls = getattr(_errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError


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

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        dev = self._comm_device()
        x = t.detach().to(dev).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x)
        return out

    def _gather_objects(self, obj) -> list:
        """``obj`` of every rank, in rank order. Tensors inside travel as ``torch.save`` bytes (the pickling of
        ``all_gather_object`` does not carry every dtype, e.g. float8); the peers are this job's own ranks."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        out = [None] * self.world
        dist.all_gather_object(out, buf.getvalue())
        return [torch.load(io.BytesIO(b), weights_only=False) for b in out]

    def synced(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on every rank, then a comparison of the outcomes: when any rank raised, every
        rank raises (see the module docstring). The identity when not distributed."""
        if not self.enabled:
            return fn(*args, **kwargs)
        err = None
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001: every failure is passed to the other ranks
            err = exc
        seen = self._gather_objects(None if err is None else (type(err).__name__, str(err)))
        _PASSED[0] += 1
        failed = [(r, e) for r, e in enumerate(seen) if e is not None]
        if not failed:
            return out
        if err is None:
            r, (name, msg) = failed[0]
            err = _error_class(name)(f"rank {r}: {msg}")
        setattr(err, _SYNCED, True)
        raise err

    # ------------------------------------------------------------------ calibration rows
    def shard(self, batches: list[torch.Tensor], calibration: torch.Tensor) -> list[torch.Tensor]:
        """This rank's contiguous block of the calibration ``batches`` (a UsageError on every rank when the
        ranks were given different calibration ids)."""
        if not self.enabled:
            return batches

        def check():
            ids = calibration.detach().reshape(-1).to(torch.int64).cpu()
            w = torch.arange(1, ids.numel() + 1, dtype=torch.int64) % 1000003
            mine = (tuple(calibration.shape), int((ids * w).sum()), int(ids.sum()))
            prints = self._gather_objects(mine)
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
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
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
               schemes: dict, outer_scale: str = "expert"):
        """``method``, or (distributed, and the method's ``quantize_weight`` reads statistics) a stand-in whose
        ``quantize_weight`` returns the results solved over ranks: weight j on rank ``j % world``, all
        gathered. A weight whose solve raised is left out, so ``quantize_model`` solves it (and raises) on
        every rank itself."""
        if not self.enabled or not method.quantizes_with_statistics or (stats is None and ex_stats is None):
            return method
        try:
            jobs = _jobs(model, linears, experts, stats, ex_stats, schemes, outer_scale)
        except Exception:  # noqa: BLE001: every rank solves locally (and raises the same error) instead
            return method
        mine = {}
        for j, (key, w, st, spec, S) in enumerate(jobs):
            if j % self.world != self.rank:
                continue
            try:
                res = method.quantize_weight(w, st, spec, S)
            except Exception:  # noqa: BLE001: solved again (and raised) on every rank by quantize_model
                continue
            mine[key] = (res.q.to("cpu"), res.note)
        results = {}
        for got in self._gather_objects(mine):
            results.update(got)
        devices = {key: w.device for key, w, *_ in jobs}
        return _Solved(method, {k: QuantizedWeight(q.to(devices[k]), note) for k, (q, note) in results.items()})


class _Solved:
    """A PTQ method whose ``quantize_weight`` answers from solved results (by statistics name)."""

    def __init__(self, method, results: dict):
        self._method, self._results = method, results

    def __getattr__(self, name):
        return getattr(self._method, name)

    def quantize_weight(self, weight, stats, spec, encode_scale):
        res = self._results.get(stats.name) if stats is not None else None
        if res is None or tuple(res.q.shape) != tuple(weight.shape):
            return self._method.quantize_weight(weight, stats, spec, encode_scale)
        return res


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
        if is_gpt_oss_experts(module):
            W_gu, W_dn = gpt_oss_expert_matrices(module)
        else:
            W_gu, W_dn = module.gate_up_proj.detach(), module.down_proj.detach()
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


__all__ = ["CalibrationRanks", "calibration_ranks", "printed_by_rank0"]
