"""How much each unit's output suffers under each candidate scheme, measured on calibration text.

For a unit (``units.Unit``) with full-precision output y and y_q, its output with the candidate's weights
round-to-nearest quantized as PTQ's RTN does (``scheme_quantize.group_weight_scale`` shared by each fused group,
``rtn_quantize``) AND its activations fake-quantized as the scheme's inference module does
(``Scheme.input_quantizer``; static scales from the input amax the unit saw on the calibration text, a fused
group's max, per expert and projection for fused experts), both computed from the unit's captured inputs:

    "fisher"  1/2 sum over calibration positions and output channels of (dL/dy)^2 (y_q - y)^2, divided by the
              number of predicted tokens: the diagonal-Fisher (ModelOpt AutoQuantize-style) estimate of the
              increase of the mean next-token loss, in nats per token. L is each batch's summed next-token
              cross-entropy; dL/dy comes from one backward pass per batch through the full-precision model.
    "output"  sum of (y_q - y)^2 over positions and channels divided by the number of calibration tokens: the mean
              squared output error per token, NOT normalised by sum y^2 (so larger and louder units weigh more).

A fused sibling group's output is its members' outputs together; a fused-experts module's is its routed,
weighted output (the layout's own eager loop, ``nn.ExpertsLayout.eager``, for y and y_q alike). High-precision
candidates (bf16) score 0 exactly. Calibration is the full-precision model (PTQ's own static scales come from the
already quantized earlier layers: close, not equal).

The passes (model in eval mode, in float32 and with its parameters not requiring grad for the duration, all
restored afterwards; the torch RNG forked and seeded with ``seed``): (1) a forward pass per batch recording
each unit's input amax and, for MoE units, the tokens routed per expert (skipped when no candidate has static
activation scales and there is no MoE unit); (2) per batch one forward (+ backward
for "fisher": gradients w.r.t. a leaf at the first decoder layer's input, so no parameter gradient is formed)
with hooks keeping the unit's inputs and output gradients, then per unit and candidate y_q from those inputs.
Memory beyond the forward / backward: one batch's inputs and output gradients of the units; the quantized
weights of one unit and candidate at a time (recomputed per batch). Deterministic on CPU for a given seed,
calibration and thread count.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...nn.experts_layout import shell_of
from ...nn.experts_layouts import experts_layout_of
from ...nn.fused import fused_groups
from ..capture import decoder_layers
from ..scheme_quantize import group_weight_scale, rtn_quantize

ESTIMATORS = ("fisher", "output")
_PROJ = ("gate_up", "down")


@dataclass
class Sensitivity:
    """``scores[u][c]``: unit u's score under candidate c (None where the candidate does not fit it);
    ``active_fraction[u]``: the share of its parameters an average calibration token uses (1 for dense units);
    ``routed``: experts unit name -> calibration tokens routed to each expert; ``tokens``: calibration tokens."""

    scores: list[list[Optional[float]]]
    active_fraction: list[float]
    routed: dict[str, list[int]] = field(default_factory=dict)
    tokens: int = 0
    kv_scores: Optional[list[Optional[float]]] = None


@contextmanager
def _prepared(model: nn.Module, seed: int):
    """``model`` in eval mode, float32, parameters not requiring grad; the RNG seeded; all restored after."""
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    cast: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
    for mod in model.modules():
        for t in [*mod._parameters.values(), *mod._buffers.values()]:
            if t is not None and t.is_floating_point() and t.dtype != torch.float32 and id(t) not in cast:
                cast[id(t)] = (t, t.dtype)
    try:
        for t, _ in cast.values():  # (bf16 / fp16 -> fp32 -> back is exact)
            t.data = t.data.float()
        for p, _ in grads:
            p.requires_grad_(False)
        model.eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        for t, dtype in cast.values():
            t.data = t.data.to(dtype)
        for p, flag in grads:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training


def _call_args(args, kwargs):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    return vals[0], vals[1], vals[2]


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class _LinearTap:
    """A Linear or fused-group unit (or per-expert Linears): its members' input amax / rows, inputs and output
    gradients of the current batch."""

    def __init__(self, model: nn.Module, unit):
        self.unit = unit
        self.modules = {n: model.get_submodule(n) for n in unit.members}
        self.amax = {n: 0.0 for n in unit.members}
        self.rows = {n: 0 for n in unit.members}
        self.xs: dict[str, list] = {n: [] for n in unit.members}
        self.gs: dict[str, dict] = {n: {} for n in unit.members}

    def hooks(self, mode: str, fisher: bool):
        def make(n, mod):
            def stats(m, args, output):
                x = args[0].detach()
                self.amax[n] = max(self.amax[n], float(x.abs().max())) if x.numel() else self.amax[n]
                self.rows[n] += x.numel() // mod.in_features

            def score(m, args, output):
                self.xs[n].append(args[0].detach().reshape(-1, mod.in_features))
                y, i = _first(output), len(self.xs[n]) - 1
                if fisher and y.requires_grad:
                    y.register_hook(lambda g, i=i: self.gs[n].__setitem__(i, g.detach().reshape(-1, mod.out_features)))
            return stats if mode == "stats" else score
        return [mod.register_forward_hook(make(n, mod)) for n, mod in self.modules.items()]

    def clear(self) -> None:
        for n in self.unit.members:
            self.xs[n], self.gs[n] = [], {}

    def active_fraction(self, tokens: int) -> float:
        if self.unit.kind == "linear":
            return 1.0
        params = {n: m.in_features * m.out_features for n, m in self.modules.items()}
        return sum(self.rows[n] * params[n] for n in params) / (max(tokens, 1) * sum(params.values()))

    @torch.no_grad()
    def add_scores(self, candidates, allowed, fisher: bool, acc: list) -> None:
        groups = fused_groups(list(self.unit.members))  # each shares its weight scale and static input scale
        for c, s in enumerate(candidates):
            if not allowed[c] or s.is_high_precision:
                continue
            total = torch.zeros((), dtype=torch.float64)
            for group in groups:
                ws = [self.modules[n].weight.detach().float() for n in group]
                if not any(self.xs[n] for n in group):
                    continue
                shared = group_weight_scale(s, ws)
                amax = max(self.amax[n] for n in group)
                qi = s.input_quantizer(amax if amax > 0 else 1.0)
                for n, w in zip(group, ws):
                    wq = rtn_quantize(w, s.weight_spec, shared).dequantize(torch.float32)
                    for i, x in enumerate(self.xs[n]):
                        dy = F.linear(qi(x) if qi is not None else x, wq) - F.linear(x, w)
                        if fisher:
                            g = self.gs[n].get(i)
                            if g is not None:
                                total += 0.5 * (g * dy).square().sum(dtype=torch.float64)
                        else:
                            total += dy.square().sum(dtype=torch.float64)
            acc[c] += float(total)


class _ExpertsTap:
    """A fused 3-D experts unit: routing counts, per-expert input amax, the batch's calls and output gradients."""

    def __init__(self, model: nn.Module, unit, need_amax: bool):
        self.unit, self.need_amax = unit, need_amax
        self.module = model.get_submodule(unit.members[0])
        self.layout = experts_layout_of(self.module)
        E = unit.experts
        self.shim = SimpleNamespace(_hf_shell=shell_of(self.module), act_fn=getattr(self.module, "act_fn", None),
                                    num_experts=E)
        for attr in self.layout.biases.values():  # gpt-oss: high-precision biases, read by its loop
            setattr(self.shim, attr, getattr(self.module, attr).detach())
        self.routed, self.tokens = [0] * E, 0
        self.amax = {p: [0.0] * E for p in _PROJ}
        self.calls: list = []
        self.gs: dict[int, torch.Tensor] = {}

    def _record(self, x, proj, e):
        if x.numel():
            self.amax[proj][e] = max(self.amax[proj][e], float(x.detach().abs().max()))
        return x

    def hooks(self, mode: str, fisher: bool):
        E = self.unit.experts

        def stats(m, args, kwargs, output):
            h, idx, w = _call_args(args, kwargs)
            self.tokens += h.shape[0]
            flat = idx.detach().reshape(-1)
            counts = torch.bincount(flat[(flat >= 0) & (flat < E)], minlength=E)
            self.routed = [a + int(b) for a, b in zip(self.routed, counts.tolist())]
            if self.need_amax:
                gu, dn = self.layout.matrices(self.module)
                with torch.no_grad():
                    self.layout.eager(self.shim, h.detach(), idx, w.detach(), gu, dn, self._record)

        def score(m, args, kwargs, output):
            h, idx, w = _call_args(args, kwargs)
            self.calls.append((h.detach(), idx.detach(), w.detach()))
            y, i = _first(output), len(self.calls) - 1
            if fisher and y.requires_grad:
                y.register_hook(lambda g, i=i: self.gs.__setitem__(i, g.detach().reshape(-1, g.shape[-1])))
        return [self.module.register_forward_hook(stats if mode == "stats" else score, with_kwargs=True)]

    def clear(self) -> None:
        self.calls, self.gs = [], {}

    def active_fraction(self, tokens: int) -> float:
        return sum(self.routed) / (max(self.tokens, 1) * self.unit.experts)

    def _input_amax(self, proj: str) -> list[float]:
        seen = [a for a in self.amax[proj] if a > 0]
        fill = max(seen) if seen else 1.0  # an expert no token reached: the largest of the others (as PTQ)
        return [a if a > 0 else fill for a in self.amax[proj]]

    @torch.no_grad()
    def add_scores(self, candidates, allowed, fisher: bool, acc: list) -> None:
        if not self.calls:
            return
        gu, dn = (m.float() for m in self.layout.matrices(self.module))
        E, half = self.unit.experts, gu.shape[1] // 2
        ident = lambda x, proj, e: x  # noqa: E731
        ys = [self.layout.eager(self.shim, h, idx, w, gu, dn, ident) for h, idx, w in self.calls]
        amax = {p: self._input_amax(p) for p in _PROJ}
        for c, s in enumerate(candidates):
            if not allowed[c] or s.is_high_precision:
                continue
            spec = s.weight_spec
            gu_q = torch.stack([rtn_quantize(gu[e], spec, group_weight_scale(s, [gu[e, :half], gu[e, half:]]))
                                .dequantize(torch.float32) for e in range(E)])
            dn_q = torch.stack([rtn_quantize(dn[e], spec, group_weight_scale(s, [dn[e]])).dequantize(torch.float32)
                                for e in range(E)])
            qis = {p: [s.input_quantizer(amax[p][e]) for e in range(E)] for p in _PROJ}

            def qi(x, proj, e, qis=qis):
                f = qis[proj][e]
                return x if f is None else f(x)

            total = torch.zeros((), dtype=torch.float64)
            for i, ((h, idx, w), y) in enumerate(zip(self.calls, ys)):
                dy = self.layout.eager(self.shim, h, idx, w, gu_q, dn_q, qi) - y
                if fisher:
                    g = self.gs.get(i)
                    if g is not None:
                        total += 0.5 * (g * dy).square().sum(dtype=torch.float64)
                else:
                    total += dy.square().sum(dtype=torch.float64)
            acc[c] += float(total)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    try:
        out = model(input_ids=ids, use_cache=False)
    except TypeError:  # not a transformers model: plain forward(idx)
        out = model(ids)
    return _first(getattr(out, "logits", out))


def _forward_backward(model: nn.Module, first_layer: nn.Module, ids: torch.Tensor) -> None:
    """One forward and the backward of the summed next-token cross-entropy down to a leaf made of the first
    decoder layer's input (tensor hooks on the units' outputs receive their gradients)."""
    leaf = []

    def make_leaf(mod, args, kwargs):
        if args:
            leaf.append(args[0].detach().requires_grad_(True))
            return (leaf[0], *args[1:]), kwargs
        leaf.append(kwargs["hidden_states"].detach().requires_grad_(True))
        return args, {**kwargs, "hidden_states": leaf[0]}

    handle = first_layer.register_forward_pre_hook(make_leaf, with_kwargs=True)
    try:
        with torch.enable_grad():
            logits = _logits(model, ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                                   reduction="sum")
            torch.autograd.grad(loss, leaf[:1])
    finally:
        handle.remove()


def measure(model: nn.Module, units, candidates, allowed, ids: torch.Tensor, estimator: str = "fisher",
            batch_size: int = 4, seed: int = 0, kv_tap=None) -> Sensitivity:
    """Scores of every unit under every allowed candidate (``allowed[u][c]``) on calibration token ids ``ids``
    [n, T] (see the module docstring), in batches of ``batch_size`` windows; with ``kv_tap`` (a
    ``kv_cache.KVTap``) the KV candidates' scores too, from the same passes (``Sensitivity.kv_scores``)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; allowed values: {', '.join(map(repr, ESTIMATORS))}")
    fisher = estimator == "fisher"
    device = next(model.parameters()).device
    batches = [b.to(device) for b in ids.split(batch_size)]
    need_amax = any(s.static_activations for s in candidates)
    taps = [_ExpertsTap(model, u, need_amax) if u.kind == "experts" else _LinearTap(model, u) for u in units]
    acc = [[0.0] * len(candidates) for _ in units]
    first_layer = decoder_layers(model)[0]
    # input amax / routing counts / KV amax needed
    stats = need_amax or any(u.kind != "linear" for u in units) or kv_tap is not None
    with _prepared(model, seed):
        for mode in ("stats", "score") if stats else ("score",):
            handles = [h for t in taps for h in t.hooks(mode, fisher)]
            handles += kv_tap.hooks(mode, fisher) if kv_tap is not None else []
            try:
                for batch in batches:
                    if mode == "stats" or not fisher:
                        with torch.no_grad():
                            _logits(model, batch)
                    else:
                        _forward_backward(model, first_layer, batch)
                    if mode == "score":
                        for t, a, ok in zip(taps, acc, allowed):
                            t.add_scores(candidates, ok, fisher, a)
                            t.clear()
                        if kv_tap is not None:
                            kv_tap.add_scores(fisher)
                            kv_tap.clear()
            finally:
                for h in handles:
                    h.remove()
                for t in taps + ([kv_tap] if kv_tap is not None else []):
                    t.clear()
    n, T = ids.shape
    per = n * (T - 1) if fisher else n * T
    scores = [[(a / per if not s.is_high_precision else 0.0) if ok[c] else None
               for c, (a, s) in enumerate(zip(row, candidates))] for row, ok in zip(acc, allowed)]
    routed = {t.unit.name: list(t.routed) for t in taps if isinstance(t, _ExpertsTap)}
    kv = kv_tap.scores(per) if kv_tap is not None else None
    return Sensitivity(scores, [t.active_fraction(n * T) for t in taps], routed, n * T, kv)


__all__ = ["ESTIMATORS", "Sensitivity", "measure"]
