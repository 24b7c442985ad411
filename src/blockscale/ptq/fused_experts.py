"""PTQ of fused 3-D MoE experts (transformers >= 5 Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE experts modules):
per-expert statistics from the tokens routed to each expert, per-expert weights in the experts' PTQ scheme (NVFP4,
FP8 or MX: mixed recipes can give the experts any), one ``QuantizedExperts`` of the experts' Linears.

Statistics (``ExpertStatistics``): per expert e and projection, an ``InputStatistics`` with the method's
``StatisticsRequest`` (GPTQ: Hessians, AWQ: samples, SmoothQuant: per-channel max; always tokens and
amax): the gate/up input is the hidden states routed to e (in the transformers eager loop's order: by
top-k slot, then token), the down input its act(gate) * up (full-precision weights, the eager loop's
operations). With ``calibrate_all`` every calibration token goes through every expert, for statistics
only (the hook's own computation; the module's output stays the routed one).

Outer scales (``outer_scale``): "expert": gate/up rows of expert e share one outer scale
``S = shared_outer_scale([gate_e, up_e])``, down has its own; "tensor": one S for all experts' gate+up
rows and one for all downs. Weights are the method's ``quantize_weight`` of each expert's [2I, H] /
[H, I] matrix with that S and the expert's statistics (RTN with the scheme's scale rule: 6, 4over6,
sweep; GPTQ with the expert's own Hessian). FP8 / MX schemes: the same with the scheme's weight spec; the
per-tensor FP8 scale s = amax / 448 plays the part of S (gate and up of one expert share it; "tensor": one
for all experts), per-channel / 128x128-block FP8 and MX scales are each expert's own ("tensor" is refused
for them). Static activations (W4A4, fp8-w8a8 static): the input amax of expert e's gate/up and down GEMMs
from its statistics. An expert no calibration token reached gets RTN weights (GPTQ has no Hessian for
it) and, with static activations, the largest input amax of the layer's other experts (else of the layer's Linears,
else 1): finite scales, and a report note.

gpt-oss (``GptOssExperts``: gate_up_proj [E, H, 2I] transposed, gate / up interleaved, biases, clamped GLU):
the same, on the out x in matrices gate_up_proj[e]^T [2I, H] (rows interleaved) / down_proj[e]^T [H, I]; the
down input is ``_apply_gate(x @ gate_up_proj[e] + gate_up_proj_bias[e])``; the result an
``NVFP4GptOssExperts`` / gpt-oss ``SchemeExperts`` (biases kept in high precision). What differs between the
two layouts is their ``nn.experts_layout.ExpertsLayout``.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import QuantizationError
from ..nn.experts_layouts import experts_layout_of
from ..nn.quantized_experts import QuantizedExperts
from .scheme_modules import build_linear
from .scheme_quantize import group_weight_scale, rtn_quantize
from .statistics import InputStatistics, StatisticsRequest

_PROJ = ("gate_up", "down")
OUTER_SCALE_MODES = ("expert", "tensor")


@dataclass
class ExpertsReport:
    """One fused-experts module: ``tokens`` per expert its statistics saw (None without calibration; every
    calibration token with ``calibrate_all``), ``routed_tokens`` per expert (the tokens the router sent it),
    per-expert weight relative MSE and (W4A4) input amax per projection, and with Hessians (GPTQ) the
    per-expert output error ``tr(dW H dW^T) / tr(W H W^T)`` (None for an expert without tokens) and that of
    RTN with the same S; ``outer_scale``: "expert" or "tensor"; notes (e.g. experts no token reached)."""

    name: str
    experts: int
    gate_up_shape: tuple[int, int, int]
    down_shape: tuple[int, int, int]
    tokens: Optional[list[int]] = None
    weight_rel_mse: dict[str, list[float]] = field(default_factory=dict)
    input_amax: Optional[dict[str, list[float]]] = None
    note: str = ""
    scheme: str = ""
    routed_tokens: Optional[list[int]] = None
    output_rel_err: Optional[dict[str, list[Optional[float]]]] = None
    rtn_output_rel_err: Optional[dict[str, list[Optional[float]]]] = None
    outer_scale: str = "expert"


class ExpertStatistics:
    """Statistics of one fused-experts module's calibration inputs, per expert and projection
    (``stats[proj][e]``: an ``InputStatistics`` recording what ``request`` asks for), from its forward
    calls' routing; with ``calibrate_all`` every token of every call goes to every expert (statistics
    only). ``routed[e]``: the tokens the router sent expert e either way."""

    def __init__(self, name: str, module: nn.Module, layer: int, total_tokens: int, device,
                 request: StatisticsRequest = StatisticsRequest(), calibrate_all: bool = False):
        self.layout = experts_layout_of(module)  # its sizes and the operations leading to the down input
        E, H, I = self.layout.dims(module)
        self.name, self.module, self.calibrate_all = name, module, calibrate_all
        self.stats = {p: [InputStatistics(f"{name} (expert {e}, {p} input)", layer, k, request, total_tokens, device)
                          for e in range(E)] for p, k in zip(_PROJ, (H, I))}
        self.routed = [0] * E

    @torch.no_grad()
    def add(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> None:
        m = self.module
        E = m.gate_up_proj.shape[0]
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)
        for e in range(E):
            _, token_idx = torch.where(expert_mask[e])
            self.routed[e] += int(token_idx.numel())
            current_state = hidden_states if self.calibrate_all else hidden_states[token_idx]
            self.stats["gate_up"][e].add(current_state)
            self.stats["down"][e].add(self.layout.down_input(m, e, current_state))

    def tokens(self) -> list[int]:
        """Tokens each expert's statistics saw (the routed ones, or all with ``calibrate_all``)."""
        return [s.tokens for s in self.stats["gate_up"]]


def _call_args(args, kwargs):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    return vals[0], vals[1]


@contextmanager
def observe_experts(experts: dict[str, nn.Module], layer: int, total_tokens: int, device,
                    request: StatisticsRequest = StatisticsRequest(), calibrate_all: bool = False):
    """Forward hooks recording ``ExpertStatistics`` (with ``request``, ``calibrate_all``) of each
    fused-experts module (name -> it) while the layer runs; yields name -> ExpertStatistics. The
    modules' outputs are unchanged."""
    out = {n: ExpertStatistics(n, m, layer, total_tokens, device, request, calibrate_all) for n, m in experts.items()}
    handles = [m.register_forward_hook(lambda mod, a, kw, o, s=out[n]: s.add(*_call_args(a, kw)), with_kwargs=True)
               for n, m in experts.items()]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _rel(q, w: torch.Tensor) -> float:
    wf = w.float()
    return float((q.dequantize(torch.float32) - wf).pow(2).sum() / wf.pow(2).sum().clamp_min(1e-30))


def _input_amax(stats: list[InputStatistics], fallback: float) -> tuple[list[float], list[int]]:
    """Per-expert input amax (unrouted experts: the largest of the others, else ``fallback``) and the
    unrouted experts."""
    seen = [s.amax for s in stats if s.tokens]
    fill = max(seen) if seen else fallback
    return [s.amax if s.tokens else fill for s in stats], [e for e, s in enumerate(stats) if not s.tokens]


def _outer_scales(scheme, W_gu: torch.Tensor, W_dn: torch.Tensor, mode: str) -> dict[str, list]:
    """Per projection, the weight scale every expert's matrix is quantized with (``group_weight_scale``: the
    NVFP4 outer scale S, the per-tensor FP8 scale; None for schemes whose scales are all per block / row):
    "expert" (gate and up of one expert share one since they are one GEMM), "tensor" (one for all experts'
    gate+up rows, one for all downs; a QuantizationError for a scheme without a per-tensor scale)."""
    E, I = W_gu.shape[0], W_gu.shape[1] // 2
    if mode == "tensor":
        out = {"gate_up": [group_weight_scale(scheme, list(W_gu))] * E,
               "down": [group_weight_scale(scheme, list(W_dn))] * E}
        if out["down"][0] is None:
            raise QuantizationError(f"expert_outer_scale='tensor' shares one weight scale between all experts, but "
                                    f"scheme {scheme.label} has none to share (its scales are per row or per block); "
                                    "use expert_outer_scale='expert'")
        return out
    if mode != "expert":
        raise ValueError(f"expert_outer_scale={mode!r}; allowed values: {', '.join(map(repr, OUTER_SCALE_MODES))}")
    return {"gate_up": [group_weight_scale(scheme, [W_gu[e, :I], W_gu[e, I:]]) for e in range(E)],
            "down": [group_weight_scale(scheme, [W_dn[e]]) for e in range(E)]}


def _output_err(dw: torch.Tensor, wf: torch.Tensor, H: torch.Tensor) -> float:
    return float(((dw @ H) * dw).sum() / ((wf @ H) * wf).sum().clamp_min(1e-30))


def _quantize_one(method, w: torch.Tensor, st: Optional[InputStatistics], spec, S: torch.Tensor):
    """One expert's projection: (q, weight rel MSE, output rel error on its Hessian or None, RTN's or None,
    the method's note)."""
    res = method.quantize_weight(w, st, spec, S)
    H = st.H if st is not None else None
    wf = w.float()
    out = rtn = None
    if H is not None:
        out = _output_err(res.q.dequantize(torch.float32) - wf, wf, H)
        if method.compares_to_rtn:
            rtn = _output_err(rtn_quantize(w, spec, S).dequantize(torch.float32) - wf, wf, H)
    return res.q, _rel(res.q, w), out, rtn, res.note


@dataclass(frozen=True)
class ExpertsStart:
    """What ``PTQMethod.reconstruct_layer`` starts from for one fused-experts module: its ``layout``
    (``nn.ExpertsLayout``), ``scheme``, and per projection ("gate_up" / "down") and expert: ``names`` the
    statistics name ``quantize_one_experts`` will ask the method about, ``q`` the method's own
    ``quantize_weight`` result (the out x in matrix with the scale ``quantize_one_experts`` gives it), and
    ``input_amax`` the calibrated input amax (static activations only, else None)."""

    layout: object
    scheme: object
    names: dict
    q: dict
    input_amax: Optional[dict] = None


def experts_start(module: nn.Module, scheme, method, est: ExpertStatistics, fallback_amax: float,
                  outer_scale: str = "expert") -> ExpertsStart:
    """The ``ExpertsStart`` of ``module`` (exactly the ``quantize_weight`` calls ``quantize_one_experts`` makes)."""
    layout = experts_layout_of(module)
    W_gu, W_dn = layout.matrices(module)
    S_all = _outer_scales(scheme, W_gu, W_dn, outer_scale)
    names, qs = {p: [] for p in _PROJ}, {p: [] for p in _PROJ}
    for e in range(W_gu.shape[0]):
        for p, w in (("gate_up", W_gu[e]), ("down", W_dn[e])):
            st = est.stats[p][e]
            names[p].append(st.name)
            qs[p].append(method.quantize_weight(w, st, scheme.weight_spec, S_all[p][e]).q)
    amax = {p: _input_amax(est.stats[p], fallback_amax)[0] for p in _PROJ} if scheme.static_activations else None
    return ExpertsStart(layout, scheme, names, qs, amax)


def quantize_one_experts(name: str, module: nn.Module, scheme, method, est: Optional[ExpertStatistics],
                         fallback_amax: float, outer_scale: str = "expert") -> tuple[nn.Module, ExpertsReport]:
    """``module`` under ``scheme`` (outer scales per ``outer_scale``: "expert" or "tensor") and its report:
    a ``QuantizedExperts`` (as ``NVFP4Experts`` / ``NVFP4GptOssExperts`` / ``SchemeExperts``) whose experts' GEMMs are
    the scheme's inference Linears (static activations: one calibrated input scale per expert and projection)."""
    spec = scheme.weight_spec
    W_gu, W_dn = experts_layout_of(module).matrices(module)  # out x in (gpt-oss: transposed, rows interleaved)
    E = W_gu.shape[0]
    S_all = _outer_scales(scheme, W_gu, W_dn, outer_scale)
    qs, rel, out_rel, rtn_rel = ({p: [] for p in _PROJ} for _ in range(4))
    odd = []  # the method's notes for experts that had statistics
    for e in range(E):
        for p, w in (("gate_up", W_gu[e]), ("down", W_dn[e])):
            st = est.stats[p][e] if est is not None else None
            q, r, o, ro, note = _quantize_one(method, w, st, spec, S_all[p][e])
            for d, v in ((qs, q), (rel, r), (out_rel, o), (rtn_rel, ro)):
                d[p].append(v)
            if note and st is not None and st.tokens:
                odd.append(f"expert {e} {p}: {note}")
    notes, amaxes = [], None
    unrouted = [e for e, t in enumerate(est.tokens()) if t == 0] if est is not None else []
    if scheme.static_activations:  # calibrated input scales, one per expert and projection
        amaxes = {p: [fallback_amax] * E if est is None else _input_amax(est.stats[p], fallback_amax)[0]
                  for p in _PROJ}
    if unrouted:
        line = (f"no calibration tokens routed to expert(s) {unrouted}: RTN weights"
                + (", input amax from the layer's other experts" if amaxes is not None else ""))
        notes.append(line)
    notes.extend(odd)
    # each expert's GEMM as its scheme's inference Linear (gate and up of one expert share one outer scale), stacked
    lin = {p: [build_linear(qs[p][e], None, scheme, amaxes[p][e] if amaxes else 0.0, W_gu.dtype)
               for e in range(E)] for p in _PROJ}
    new = QuantizedExperts.from_linears(module, lin["gate_up"], lin["down"])
    has_h = any(v is not None for v in out_rel["gate_up"] + out_rel["down"])
    rep = ExpertsReport(name, E, tuple(W_gu.shape), tuple(W_dn.shape), est.tokens() if est is not None else None,
                        rel, amaxes, "; ".join(notes), scheme.label,
                        routed_tokens=list(est.routed) if est is not None else None,
                        output_rel_err=out_rel if has_h else None,
                        rtn_output_rel_err=rtn_rel if has_h and method.compares_to_rtn else None,
                        outer_scale=outer_scale)
    return new, rep


def quantize_experts(root: nn.Module, experts: dict[str, nn.Module], ex_stats: Optional[dict], schemes: dict,
                     method, reports: list, warnings: list, fallback_amax: float, outer_scale: str = "expert") -> None:
    """Replace every fused-experts module of ``experts`` (name -> module) in ``root`` by its
    ``QuantizedExperts`` (outer scales per ``outer_scale``); reports appended to ``reports``, notes to
    ``warnings``. A ValueError quantizing one becomes a QuantizationError naming it."""
    for name, module in experts.items():
        est = ex_stats.get(name) if ex_stats else None
        try:
            new, rep = quantize_one_experts(name, module, schemes[name], method, est, fallback_amax, outer_scale)
        except QuantizationError:
            raise
        except ValueError as err:
            raise QuantizationError(f"{name}: {err}") from err
        reports.append(rep)
        if rep.note:
            warnings.append(f"{name}: {rep.note}")
        _replace(root, name, new)


def experts_summary(reports: list) -> Optional[str]:
    """One line about the fused-experts modules PTQ quantized (``ExpertsReport`` list), None when none:
    how many, the outer-scale mode, and the calibration tokens routed per expert (min / median / max
    over every expert of every module, and how many experts got none)."""
    if not reports:
        return None
    modes = sorted({r.outer_scale for r in reports})
    line = (f"quantized {len(reports)} fused-experts module{'s' if len(reports) != 1 else ''} "
            f"({sum(r.experts for r in reports)} experts; outer scale per {'/'.join(modes)})")
    routed = sorted(t for r in reports if r.routed_tokens is not None for t in r.routed_tokens)
    if routed:
        none = sum(1 for t in routed if t == 0)
        line += (f"; calibration tokens routed per expert: min {routed[0]}, median {routed[len(routed) // 2]}, "
                 f"max {routed[-1]}" + (f", {none} expert{'s' if none != 1 else ''} got none" if none else ""))
        if any(r.tokens is not None and r.routed_tokens is not None and r.tokens != r.routed_tokens for r in reports):
            line += "; expert statistics from every calibration token (calibrate_all_experts)"
    return line


_EXPERT_PARENT = re.compile(r"(.*\.experts)\.\d+")


def expert_scale_groups(groups: list[list[str]], mode: str, schemes: dict) -> list[list[str]]:
    """The groups of Linear names that share one weight scale, for the older per-expert nn.Linear
    layout (``<m>.experts.{e}.<leaf>``): with ``mode="expert"`` the fused ``groups`` themselves (w1/w3 or
    gate/up of one expert); with ``"tensor"`` the same fused group of every expert of ``<m>.experts``
    merged into one (as for fused 3-D experts). Other groups are returned as they are. A merged group
    whose experts have different schemes is a QuantizationError naming two of them."""
    if mode not in OUTER_SCALE_MODES:
        raise ValueError(f"expert_outer_scale={mode!r}; allowed values: {', '.join(map(repr, OUTER_SCALE_MODES))}")
    if mode == "expert":
        return [list(g) for g in groups]
    merged: dict[tuple, list[str]] = {}
    for g in groups:
        parent = g[0].rpartition(".")[0]
        m = _EXPERT_PARENT.fullmatch(parent)
        key = (m.group(1), tuple(sorted(n.rpartition(".")[2] for n in g))) if m else (g[0], None)
        merged.setdefault(key, []).extend(g)
    for g in merged.values():
        bad = next((n for n in g if schemes[n] != schemes[g[0]]), None)
        if bad is not None:
            raise QuantizationError(f"{g[0]} and {bad}: expert_outer_scale='tensor' shares one outer scale between "
                                    f"all experts, but their schemes differ ({schemes[g[0]].label} vs "
                                    f"{schemes[bad].label}); use expert_outer_scale='expert'")
    return list(merged.values())


__all__ = ["ExpertStatistics", "ExpertsReport", "ExpertsStart", "OUTER_SCALE_MODES", "expert_scale_groups",
           "experts_start", "experts_summary", "observe_experts", "quantize_experts", "quantize_one_experts"]
