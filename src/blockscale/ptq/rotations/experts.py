"""Rotations on MoE decoder layers: ``rotate_model``'s helpers for the layers of the smoothing family "moe"
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss). The structure comes from
``smoothing.moe.find_moe_smoothing_groups``: the post-attention norm and every consumer of its output (the router,
every routed expert's gate / up, the shared expert's gate / up, Qwen2-MoE's shared_expert_gate).

R1 commutes with routing. The norm weight g is folded into every consumer and each takes W <- W Q1, so the
router's logits ``(x Q1)(diag(g) W Q1)^T (+ b) = (x g) W^T (+ b)`` are unchanged: every token picks the same
experts with the same weights. Every writer of the residual stream takes its output rows W <- Q1^T W (bias
b <- Q1^T b): o_proj, the shared expert's down_proj and each routed expert's down; the MoE block's output, a
per-token weighted sum of expert outputs, is then rotated by Q1 like the residual stream. Fused 3-D experts, per
expert e along the hidden dim H wherever it sits:

  standard (Mixtral, Qwen-MoE, OLMoE)  gate_up_proj [E, 2I, H]: W[e] <- W[e] Q1      down_proj [E, H, I]: Q1^T W[e]
  gpt-oss (x @ W layout)               gate_up_proj [E, H, 2I]: W[e] <- Q1^T W[e]    down_proj [E, I, H]: W[e] Q1,
                                       down_proj_bias [E, H]: b[e] <- b[e] Q1 (gate_up_proj_bias: unchanged)
  per-expert nn.Linear (transformers 4)  like dense Linears

R2 is attention-only (v_proj rows, o_proj columns): nothing MoE-specific. Online rotations (R4, quip, block:N,
mr) rotate only the dense nn.Linear modules (attention, the shared expert, a dense MLP); the routed experts stay
unrotated and are listed (an online rotation inside the fused-experts forward is not built, and vLLM's FusedMoE
applies no compressed-tensors transforms either); a router (or shared_expert_gate) is never rotated online: it
stays in high precision. MLA attention (DeepSeek-V2 / V3) is refused for every rotation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import QuantizationError
from ...quant.transforms.rotation import Rotation
from ..smoothing.groups import SmoothingGroup
from ..smoothing.moe import MoESmoothingGroup, find_moe_smoothing_groups
from ..smoothing.slices import WeightSlice

ROUTED = ("routed experts stay unrotated online: an online rotation inside the fused-experts forward is not built "
          "(vLLM's FusedMoE applies no compressed-tensors transforms either)")
ROUTER = "router: kept in high precision, never rotated online"
_MLA = ("kv_a_proj_with_mqa", "q_a_proj")
_WRITERS = ("o_proj", "down_proj", "w2")


@dataclass(frozen=True)
class NormGroup:
    """The post-attention norm's group as ``model._analyse`` reads a ``SmoothingGroup``: the norm (``prev``),
    its nn.Linear consumers (``linears``; the other consumers are ``MoEParts.slices``)."""

    prev: nn.Module
    linears: tuple[nn.Linear, ...]
    norm_offset: float = 0.0


@dataclass
class MoEParts:
    """What R1 rotates in an MoE layer besides its nn.Linears, and what online rotations leave alone.

    norm: the post-attention norm; slices: its consumers that are no nn.Linear, as [N, H] views (a router's
    weight, each fused expert's gate_up); outputs: each fused expert's down as an [H, I] view; biases:
    (down_proj_bias, expert) of gpt-oss; fixed: {Linear name: why} never rotated online (routers, per-expert
    Linears); experts: the routed experts' module names (relative to the layer)."""

    norm: nn.Module
    slices: list[WeightSlice] = field(default_factory=list)
    outputs: list[WeightSlice] = field(default_factory=list)
    biases: list[tuple[nn.Parameter, int]] = field(default_factory=list)
    fixed: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)


def _whole_linear(w: WeightSlice) -> bool:
    return (isinstance(w.module, nn.Linear) and w.param == "weight" and w.expert is None and w.rows is None
            and w.index is None and not w.transposed)


def _is_router(name: str) -> bool:
    return name.count(".") == 1 and name.rsplit(".", 1)[1] in ("gate", "router", "shared_expert_gate")


def moe_layer(layer: nn.Module, where: str) -> tuple[list, MoEParts]:
    """(groups for ``model._analyse``: ``SmoothingGroup``s and one ``NormGroup``; the ``MoEParts``) of an MoE
    decoder layer. QuantizationError naming ``where`` for MLA attention or a layout smoothing does not know."""
    attn = getattr(layer, "self_attn", None)
    mla = [f"self_attn.{n}" for n in _MLA if isinstance(getattr(attn, n, None), nn.Module)]
    if mla:
        raise QuantizationError(
            f"{where}: rotations do not support MLA attention ({type(layer).__name__}: {', '.join(mla)} feeding the "
            "latent norms kv_a_layernorm / q_a_layernorm, values read through kv_b_proj): R1 / R2 folds through the "
            "latent projections are not built; quantize without --rotate")
    try:
        groups, _ = find_moe_smoothing_groups(layer)
    except (NotImplementedError, ValueError) as err:
        raise QuantizationError(f"{where}: rotations need an MoE layer of a known layout: {err}") from err
    out, parts = [], None
    for g in groups:
        if isinstance(g, SmoothingGroup):
            out.append(g)
        elif isinstance(g, MoESmoothingGroup) and not isinstance(g.prev, WeightSlice):  # the post-attention norm
            if parts is not None:
                raise QuantizationError(f"{where}: rotations expect one norm group in the MoE block, found two")
            parts, linears = MoEParts(g.prev), []
            for c in g.consumers:
                if _whole_linear(c.weight):
                    linears.append(c.weight.module)
                    if _is_router(c.name):
                        parts.fixed[c.name] = ROUTER
                else:
                    parts.slices.append(c.weight)
            out.append(NormGroup(g.prev, tuple(linears)))
    if parts is None:  # a dense MLP in an MoE family's layer (Qwen-MoE's mlp_only_layers): nothing MoE-specific
        return out, MoEParts(layer.post_attention_layernorm)
    _expert_outputs(layer, where, parts)
    return out, parts


def _expert_outputs(layer: nn.Module, where: str, parts: MoEParts) -> None:
    """The residual writers of the routed experts (``parts.outputs`` / ``biases``), their names, checked."""
    H = parts.norm.weight.numel()
    seen: dict[int, str] = {}
    names = {id(m): n for n, m in layer.named_modules()}
    for s in parts.slices:
        if s.param != "gate_up_proj":  # a router's weight [E, H]: an input side only
            continue
        ex = s.module
        out = WeightSlice(ex, "down_proj", s.expert, transposed=s.transposed)
        if s.tensor().shape[1] != H or out.tensor().shape[0] != H:
            raise QuantizationError(f"{where}.{names[id(ex)]}: expert {s.expert}'s gate_up {tuple(s.tensor().shape)} "
                                    f"/ down {tuple(out.tensor().shape)} do not read / write the hidden size {H}")
        parts.outputs.append(out)
        bias = ex._parameters.get("down_proj_bias")
        if bias is not None:
            if tuple(bias.shape) != (ex.down_proj.shape[0], H):
                raise QuantizationError(f"{where}.{names[id(ex)]}: down_proj_bias {tuple(bias.shape)}, expected "
                                        f"[E, {H}]")
            parts.biases.append((bias, s.expert))
        seen[id(ex)] = names[id(ex)]
    parts.experts += seen.values()
    for name, m in layer.named_modules():  # the per-expert nn.Linear layout: fused by R1 like dense Linears
        prefix, _, rest = name.partition(".experts.")
        if rest and isinstance(m, nn.Linear):
            parts.fixed[name] = ROUTED
            if f"{prefix}.experts" not in parts.experts:
                parts.experts.append(f"{prefix}.experts")


def finish_moe_layer(info, parts: MoEParts, plan) -> None:
    """The MoE part of ``model._analyse`` on its ``_Layer`` ``info``: R1's residual writers checked (nn.Linear
    ones: o_proj and down_proj / w2 of the shared expert, a dense MLP or per-expert Linears, all writing H), R4's
    down_proj (the shared expert's, a dense MLP's, or none), routers and routed experts kept out of ``linears``
    (no online rotation)."""
    rel = {id(m): n for n, m in info.linears.items()}
    writers = [rel[id(w)] for w in info.writers]
    if plan.r1:
        H = parts.norm.weight.numel()
        bad = [n for n, w in zip(writers, info.writers) if w.out_features != H or not n.endswith(_WRITERS)]
        if bad or sum(n.endswith("o_proj") for n in writers) != 1 or not (
                parts.outputs or any(n.endswith(_WRITERS[1:]) for n in writers)):
            raise QuantizationError(f"{info.prefix}: rotation R1 expects o_proj and the experts' down_proj to write "
                                    f"the residual stream (hidden size {H}), found Linears {writers}")
    info.moe = parts
    info.down = next((w for n, w in zip(writers, info.writers)
                      if n.endswith(_WRITERS[1:]) and n not in parts.fixed), None)
    info.linears = {n: m for n, m in info.linears.items() if n not in parts.fixed}


@torch.no_grad()
def fold_moe_r1(parts: MoEParts, q1: Rotation) -> None:
    """R1 on what ``MoEParts`` holds (before the norm weight is reset: its g is folded into ``slices`` here), in
    FP64, rounded once to each parameter's dtype."""
    g = parts.norm.weight.detach().to(torch.float64)
    for s in parts.slices:
        s.write(q1.fold_input(s.tensor().detach().to(torch.float64) * g))
    for s in parts.outputs:
        s.write(q1.fold_output(s.tensor().detach().to(torch.float64)))
    for b, e in parts.biases:
        b.data[e] = q1.fold_output(b.data[e].unsqueeze(-1)).squeeze(-1)


def moe_unrotated(infos, plan) -> list[str]:
    """``RotationReport.skipped`` lines of the MoE layers under an online rotation (R4 or quip / block:N / mr):
    the routed experts, and (input rotations) the router Linears."""
    if not (plan.r4 or plan.inputs is not None):
        return []
    out = []
    for info in infos:
        parts = getattr(info, "moe", None)
        if parts is None:
            continue
        out += [f"{info.prefix}.{n} ({ROUTED})" for n in parts.experts]
        if plan.inputs is not None:
            out += [f"{info.prefix}.{n} ({why})" for n, why in parts.fixed.items() if why == ROUTER]
    return out


__all__ = ["MoEParts", "NormGroup", "finish_moe_layer", "fold_moe_r1", "moe_layer", "moe_unrotated"]
