"""PTQ of fused 3-D MoE experts (transformers >= 5 Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE experts modules):
per-expert statistics from the tokens routed to each expert, per-expert NVFP4 weights, ``NVFP4Experts``.

Per expert e: gate/up rows share one outer scale ``S = shared_outer_scale([gate_e, up_e])``, down has its
own; weights are the method's ``quantize_weight`` of each expert's [2I, H] / [H, I] matrix with that S
(RTN with the scheme's scale rule: 6, 4over6, sweep). W4A4: the input amax of expert e's gate/up GEMM is
over the hidden states routed to it, that of its down GEMM over its act(gate) * up of those tokens
(full-precision weights, the transformers eager loop's operations). An expert no calibration token was
routed to gets RTN weights (as every expert does for now) and, for W4A4, the largest input amax of the
layer's other experts (else of the layer's Linears, else 1): finite scales, and a report note.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import QuantizationError
from ..nn.nvfp4_experts import NVFP4Experts
from ..quant.nvfp4 import input_encode_scale
from .scheme_quantize import group_weight_scale
from .statistics import InputStatistics, StatisticsRequest

_PROJ = ("gate_up", "down")


@dataclass
class ExpertsReport:
    """One fused-experts module: ``tokens`` per expert (None without calibration), per-expert weight
    relative MSE and (W4A4) input amax per projection, notes (e.g. experts no token was routed to)."""

    name: str
    experts: int
    gate_up_shape: tuple[int, int, int]
    down_shape: tuple[int, int, int]
    tokens: Optional[list[int]] = None
    weight_rel_mse: dict[str, list[float]] = field(default_factory=dict)
    input_amax: Optional[dict[str, list[float]]] = None
    note: str = ""
    scheme: str = ""


class ExpertStatistics:
    """Statistics of one fused-experts module's calibration inputs, per expert and projection
    (``stats[proj][e]``: an ``InputStatistics``), recorded from its forward calls' routing."""

    def __init__(self, name: str, module: nn.Module, layer: int, total_tokens: int, device):
        E, two_i, H = module.gate_up_proj.shape
        req = StatisticsRequest()
        self.name, self.module = name, module
        self.stats = {p: [InputStatistics(f"{name} (expert {e}, {p} input)", layer, k, req, total_tokens, device)
                          for e in range(E)] for p, k in zip(_PROJ, (H, two_i // 2))}

    @torch.no_grad()
    def add(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> None:
        m = self.module
        E = m.gate_up_proj.shape[0]
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)
        for e in range(E):
            _, token_idx = torch.where(expert_mask[e])
            current_state = hidden_states[token_idx]
            self.stats["gate_up"][e].add(current_state)
            gate, up = nn.functional.linear(current_state, m.gate_up_proj[e]).chunk(2, dim=-1)
            self.stats["down"][e].add(m.act_fn(gate) * up)

    def tokens(self) -> list[int]:
        return [s.tokens for s in self.stats["gate_up"]]


def _call_args(args, kwargs):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    return vals[0], vals[1]


@contextmanager
def observe_experts(experts: dict[str, nn.Module], layer: int, total_tokens: int, device):
    """Forward hooks recording ``ExpertStatistics`` of each fused-experts module (name -> it) while the
    layer runs; yields name -> ExpertStatistics. The modules' outputs are unchanged."""
    out = {n: ExpertStatistics(n, m, layer, total_tokens, device) for n, m in experts.items()}
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


def quantize_one_experts(name: str, module: nn.Module, scheme, method, est: Optional[ExpertStatistics],
                         fallback_amax: float) -> tuple[NVFP4Experts, ExpertsReport]:
    """``module`` as an ``NVFP4Experts`` under the NVFP4 ``scheme`` and its report."""
    spec = scheme.weight_spec
    W_gu, W_dn = module.gate_up_proj.detach(), module.down_proj.detach()
    E, two_i, H = W_gu.shape
    I = two_i // 2
    qs = {"gate_up": [], "down": []}
    rel = {"gate_up": [], "down": []}
    for e in range(E):
        for p, w, parts in (("gate_up", W_gu[e], [W_gu[e, :I], W_gu[e, I:]]), ("down", W_dn[e], [W_dn[e]])):
            S = group_weight_scale(scheme, parts)  # gate and up of one expert share one outer scale
            st = est.stats[p][e] if est is not None else None
            q = method.quantize_weight(w, st, spec, S).q
            qs[p].append(q)
            rel[p].append(_rel(q, w))
    notes, kw, amaxes = [], {}, None
    unrouted = [e for e, t in enumerate(est.tokens()) if t == 0] if est is not None else []
    if scheme.name == "nvfp4-w4a4":
        amaxes, scales = {}, {}
        for p in _PROJ:
            if est is None:
                amaxes[p] = [fallback_amax] * E
            else:
                amaxes[p], _ = _input_amax(est.stats[p], fallback_amax)
            scales[p] = torch.cat([input_encode_scale(a, scheme.act_scale_rule) for a in amaxes[p]])
        kw = dict(gate_up_input_scale=scales["gate_up"], down_input_scale=scales["down"],
                  input_scale_rule=scheme.act_scale_rule, input_error=scheme.error)
    if unrouted:
        line = (f"no calibration tokens routed to expert(s) {unrouted}: RTN weights"
                + (", input amax from the layer's other experts" if amaxes is not None else ""))
        notes.append(line)
    new = NVFP4Experts.from_experts(module, qs["gate_up"], qs["down"], **kw)
    rep = ExpertsReport(name, E, tuple(W_gu.shape), tuple(W_dn.shape), est.tokens() if est is not None else None,
                        rel, amaxes, "; ".join(notes), scheme.label)
    return new, rep


def quantize_experts(root: nn.Module, experts: dict[str, nn.Module], ex_stats: Optional[dict], schemes: dict,
                     method, reports: list, warnings: list, fallback_amax: float) -> None:
    """Replace every fused-experts module of ``experts`` (name -> module) in ``root`` by its
    ``NVFP4Experts``; reports appended to ``reports``, notes to ``warnings``. A ValueError quantizing one
    becomes a QuantizationError naming it."""
    for name, module in experts.items():
        est = ex_stats.get(name) if ex_stats else None
        try:
            new, rep = quantize_one_experts(name, module, schemes[name], method, est, fallback_amax)
        except QuantizationError:
            raise
        except ValueError as err:
            raise QuantizationError(f"{name}: {err}") from err
        reports.append(rep)
        if rep.note:
            warnings.append(f"{name}: {rep.note}")
        _replace(root, name, new)


__all__ = ["ExpertStatistics", "ExpertsReport", "observe_experts", "quantize_experts", "quantize_one_experts"]
