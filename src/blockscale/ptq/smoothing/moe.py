"""Smoothing groups of MoE decoder layers (and of DeepSeek's MLA attention): the "moe" family of
``families.SMOOTHING_FAMILIES`` routes its layers here (the dense families' groups are table rows).

Layers: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and an MLP block (``mlp`` or
``block_sparse_moe``) that is either a dense gated MLP (gate/up/down, or w1/w3/w2 nn.Linear) or an MoE
block: a router ``gate`` or ``router`` (an nn.Linear, or a router module with a 2-D ``weight`` [E, H] and
optionally a bias [E], such as transformers' TopKRouter / DeepseekV3TopkRouter / GptOssTopKRouter),
``experts`` (fused 3-D ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], gpt-oss's ``GptOssExperts``
with ``gate_up_proj`` [E, H, 2I] transposed, or an nn.ModuleList of gated expert MLPs of nn.Linear),
optionally a shared expert (``shared_expert`` / ``shared_experts``: a gated MLP) and Qwen2-MoE's
``shared_expert_gate`` (nn.Linear H -> 1). Attention: Llama-style q/k/v/o (with q_norm / k_norm, biases,
gpt-oss's per-head ``sinks`` logits, which smoothing leaves alone) or MLA (DeepSeek-V2/V3:
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` or ``q_proj``; ``kv_a_proj_with_mqa`` ->
``kv_a_layernorm`` -> ``kv_b_proj``; ``o_proj``). The groups, in the order they are folded:

  input_layernorm          -> q, k, v  (MLA: q_a_proj or q_proj, kv_a_proj_with_mqa)
  v_proj                   -> o_proj                       (Llama-style, without GQA)
  q_a_layernorm            -> q_b_proj                     (MLA)
  kv_a_layernorm           -> kv_b_proj                    (MLA)
  kv_b_proj's value rows   -> o_proj                       (MLA: attention is linear in each head's values;
                              row h * (nope + v) + nope + j feeds o_proj input h * v + j)
  post_attention_layernorm -> router, every expert's gate and up rows, shared expert gate/up,
                              shared_expert_gate           ("<mlp>.gate_up": a ``MoESmoothingGroup``)
  expert e's up rows       -> expert e's down              (exact: act(gate) * up is linear in up)
  shared expert up_proj    -> its down_proj

MLA's ``o_proj`` is left unsmoothed (with a note) only when kv_b_proj's rows are not laid out as
``num_heads x (qk_nope_head_dim + v_head_dim)``. The router is rescaled (its input is the norm's output;
a router bias is untouched: ``(x / s)(W s)^T + b``) but stays in high precision.

gpt-oss (``GptOssExperts``): expert e's consumer of the post-attention norm is ``gate_up_proj[e]`` read
transposed, the out x in matrix [2I, H] (rows interleaved gate / up) that ``NVFP4GptOssExperts`` quantizes;
its column j is gate_up_proj[e]'s row j, and the bias gate_up_proj_bias is untouched (exact:
``(x / s)(s W) + b``). There is no up -> down group (``GPT_OSS_DOWN_NOTE``): its GLU
``(clamp(up, -limit, limit) + 1) * glu(gate)`` is not linear in up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ...nn.experts_layout import has_fused_expert_parameters
from ...nn.fused_experts_layout import fused_experts_layout
from ...nn.gpt_oss_experts_layout import is_gpt_oss_experts
from .fold import check_scales, divide_norm
from .groups import FLOAT_DTYPES, SmoothingGroup, check_norm_absorbs_scales
from .slices import WeightSlice, _set_, divide_rows

_GATED = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_MLP_BLOCKS = ("mlp", "block_sparse_moe")
_SHARED = ("shared_expert", "shared_experts")
_ROUTERS = ("gate", "router")
MLA_O_PROJ_NOTE = ("o_proj not smoothed: kv_b_proj's rows are not num_heads x (qk_nope_head_dim + v_head_dim) "
                   "with o_proj reading num_heads x v_head_dim (the value rows it would fold into)")
GPT_OSS_DOWN_NOTE = ("down_proj not smoothed: gpt-oss's GLU (clamp(up, -limit, limit) + 1) * glu(gate) is not "
                     "linear in up (clamp(up / s) + 1 != (clamp(up) + 1) / s), so 1 / s cannot be folded into up")


@dataclass(frozen=True)
class Consumer:
    """One consumer of a group's input: its module name relative to the decoder layer (the fused-experts
    module's name for an expert) and its weight [N, K]."""

    name: str
    weight: WeightSlice


@dataclass(frozen=True)
class MoESmoothingGroup:
    """A smoothing group whose consumers are any 2-D weights [N_i, K] (Linears, routers, experts' slices
    of fused parameters) and whose producer ``prev`` is a norm (1-D weight absorbing 1/s) or a
    ``WeightSlice`` of output rows [K, *] (divided by s: a fused expert's up rows)."""

    name: str
    prev: Union[nn.Module, WeightSlice]
    consumers: tuple[Consumer, ...]
    prev_name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if not self.consumers:
            raise ValueError(f"MoESmoothingGroup {self.name!r}: needs at least one consumer")
        K = self.in_features
        for c in self.consumers:
            w = c.weight.tensor()
            if w.dim() != 2 or w.shape[1] != K or w.dtype not in FLOAT_DTYPES:
                raise ValueError(f"MoESmoothingGroup {self.name!r}: consumer {c.name!r} has weight "
                                 f"{tuple(w.shape)} {w.dtype}, expected floating [N, {K}]")
        if isinstance(self.prev, WeightSlice):
            if self.prev.tensor().shape[0] != K:
                raise ValueError(f"MoESmoothingGroup {self.name!r}: producer rows {tuple(self.prev.tensor().shape)}, "
                                 f"expected {K} rows")
        else:
            w = getattr(self.prev, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.numel() != K:
                raise ValueError(f"MoESmoothingGroup {self.name!r}: prev {type(self.prev).__name__} needs a 1-D "
                                 f"per-channel weight of size {K}")

    @property
    def in_features(self) -> int:
        return self.consumers[0].weight.tensor().shape[1]


def fold_moe_smoothing(group: MoESmoothingGroup, s: torch.Tensor) -> None:
    """Fold scales ``s`` [K] into ``group`` in place, as ``fold_smoothing``: every consumer's columns
    times s, the producer's output divided by s (a norm's weight and bias; output rows). FP32, then
    cast back to each parameter's dtype."""
    s = check_scales(s, group.in_features)
    prev = group.prev
    if not isinstance(prev, WeightSlice):
        check_norm_absorbs_scales(prev)  # before touching anything
    with torch.no_grad():
        if isinstance(prev, WeightSlice):
            divide_rows(prev, s)
        else:
            divide_norm(prev, s)
        for c in group.consumers:
            w = c.weight.tensor()
            _set_(w, w.float() * s.to(w.device))


def gpt_oss_expert_output(experts: nn.Module, e: int):
    """``y -> _apply_gate(y + gate_up_proj_bias[e]) @ down_proj[e]``: expert e of a ``GptOssExperts`` from its
    gate/up GEMM output y [T, 2I] (interleaved) to its output [T, H] (down_proj's bias left out: it cancels in an
    error), in FP32 with the module's current full-precision parameters. AWQ measures gpt-oss experts' errors
    there: the clamped GLU weighs the 2I outputs unequally (clamped channels not at all)."""
    def post(y: torch.Tensor) -> torch.Tensor:
        b = experts.gate_up_proj_bias[e].detach().float().to(y.device)
        return experts._apply_gate(y + b) @ experts.down_proj[e].detach().float().to(y.device)
    return post


def _gated(mlp) -> Optional[tuple[str, str, str]]:
    """(gate, up, down) attribute names when ``mlp`` is a gated MLP of nn.Linear (and nothing else)."""
    for names in _GATED:
        mods = [getattr(mlp, n, None) for n in names]
        if all(isinstance(m, nn.Linear) for m in mods):
            owned = {pn.rsplit(".", 1)[0] for pn, _ in mlp.named_parameters()}
            if owned <= set(names):
                return names
    return None


def _is_router(m) -> bool:
    """An nn.Linear, or a module whose only parameters are a 2-D ``weight`` [E, H] and optionally a
    ``bias`` [E] (gpt-oss; column scaling leaves it alone)."""
    w = getattr(m, "weight", None)
    if isinstance(m, nn.Linear):
        return True
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return False
    names = {n for n, _ in m.named_parameters()}
    b = getattr(m, "bias", None)
    return names == {"weight"} or (names == {"weight", "bias"} and isinstance(b, torch.Tensor)
                                   and tuple(b.shape) == (w.shape[0],))


def _attention_groups(layer, norm1, notes) -> tuple[list, list[str]]:
    """Groups of the attention block and the module paths they account for."""
    attn = layer.self_attn
    lin = lambda n: isinstance(getattr(attn, n, None), nn.Linear)  # noqa: E731
    if all(lin(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        groups = [SmoothingGroup("self_attn.qkv", norm1, (q, k, v),
                                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm")]
        if v.out_features == o.in_features:
            groups.append(SmoothingGroup("self_attn.o_proj", v, (o,), ("self_attn.o_proj",), "self_attn.v_proj"))
        paths = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        sinks = getattr(attn, "sinks", None)  # gpt-oss: per-head logits joining each softmax, unscaled
        if isinstance(sinks, nn.Parameter) and sinks.dim() == 1:
            paths.append("self_attn.sinks")
        return groups, paths
    if all(lin(n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")) and getattr(attn, "kv_a_layernorm", None):
        first = "q_a_proj" if lin("q_a_proj") and lin("q_b_proj") else "q_proj" if lin("q_proj") else None
        if first is None:
            raise NotImplementedError("MLA attention without q_a_proj/q_b_proj or q_proj")
        kv_a, kv_b = attn.kv_a_proj_with_mqa, attn.kv_b_proj
        ln = attn.kv_a_layernorm
        if ln.weight.numel() != kv_b.in_features:
            raise NotImplementedError(f"kv_a_layernorm has {ln.weight.numel()} channels, kv_b_proj "
                                      f"{kv_b.in_features} inputs")
        groups = [SmoothingGroup(f"self_attn.{first}_kv_a", norm1, (getattr(attn, first), kv_a),
                                 (f"self_attn.{first}", "self_attn.kv_a_proj_with_mqa"), "input_layernorm")]
        paths = [f"self_attn.{n}" for n in (first, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
        if first == "q_a_proj":
            qln = attn.q_a_layernorm
            groups.append(SmoothingGroup("self_attn.q_b_proj", qln, (attn.q_b_proj,), ("self_attn.q_b_proj",),
                                         "self_attn.q_a_layernorm"))
            paths += ["self_attn.q_a_layernorm", "self_attn.q_b_proj"]
        groups.append(SmoothingGroup("self_attn.kv_b_proj", ln, (kv_b,), ("self_attn.kv_b_proj",),
                                     "self_attn.kv_a_layernorm"))
        o = attn.o_proj
        heads, nope, vd = (getattr(attn, k, None) for k in ("num_heads", "qk_nope_head_dim", "v_head_dim"))
        if (all(isinstance(v, int) for v in (heads, nope, vd)) and kv_b.out_features == heads * (nope + vd)
                and o.in_features == heads * vd):
            # o_proj input channel h * vd + j is value channel j of head h: kv_b_proj row h * (nope + vd) + nope + j
            idx = tuple(h * (nope + vd) + nope + j for h in range(heads) for j in range(vd))
            groups.append(MoESmoothingGroup("self_attn.o_proj", WeightSlice(kv_b, index=idx),
                                            (Consumer("self_attn.o_proj", WeightSlice(o)),), "self_attn.kv_b_proj"))
        else:
            notes.append(f"self_attn.{MLA_O_PROJ_NOTE}")
        return groups, paths
    raise NotImplementedError("self_attn is neither Llama-style (q/k/v/o_proj) nor MLA "
                              "(kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)")


def _mlp_groups(layer, M: str, norm2, notes) -> tuple[list, list[str]]:
    block = getattr(layer, M)
    names = _gated(block)
    if names is not None:  # a dense gated MLP (DeepSeek's first layers, Qwen-MoE's mlp_only_layers)
        g, u, d = (getattr(block, n) for n in names)
        if u.out_features != d.in_features:
            raise NotImplementedError(f"{M}.{names[1]} has {u.out_features} outputs, {M}.{names[2]} "
                                      f"{d.in_features} inputs")
        return ([SmoothingGroup(f"{M}.gate_up", norm2, (g, u), (f"{M}.{names[0]}", f"{M}.{names[1]}"),
                                "post_attention_layernorm"),
                 SmoothingGroup(f"{M}.{names[2]}", u, (d,), (f"{M}.{names[2]}",), f"{M}.{names[1]}")],
                [f"{M}.{n}" for n in names])
    rname = next((n for n in _ROUTERS if getattr(block, n, None) is not None), None)
    router, experts = getattr(block, rname, None) if rname else None, getattr(block, "experts", None)
    if router is None or experts is None or not _is_router(router):
        raise NotImplementedError(f"{M} is neither a gated MLP nor an MoE block with a router 'gate' / 'router' "
                                  "(an nn.Linear or a module with one 2-D weight and optionally a bias) and "
                                  "'experts'")
    consumers = [Consumer(f"{M}.{rname}", WeightSlice(router))]
    down_groups, paths = [], [f"{M}.{rname}"]
    if is_gpt_oss_experts(experts):  # gate_up_proj[e] [H, 2I] read as [2I, H]; no up -> down fold
        n = f"{M}.experts"
        consumers += [Consumer(n, WeightSlice(experts, "gate_up_proj", e, transposed=True))
                      for e in range(experts.gate_up_proj.shape[0])]
        paths.append(n)
        notes.append(f"{n}.{GPT_OSS_DOWN_NOTE}")
    elif has_fused_expert_parameters(experts):
        why = fused_experts_layout(experts)
        if why is not None:
            raise NotImplementedError(f"{M}.experts: {why}")
        E, two_i, _ = experts.gate_up_proj.shape
        I = two_i // 2
        n = f"{M}.experts"
        consumers += [Consumer(n, WeightSlice(experts, "gate_up_proj", e)) for e in range(E)]
        down_groups += [MoESmoothingGroup(f"{n}.{e}.down", WeightSlice(experts, "gate_up_proj", e, (I, two_i)),
                                          (Consumer(n, WeightSlice(experts, "down_proj", e)),), n)
                        for e in range(E)]
        paths.append(n)
    elif isinstance(experts, nn.ModuleList) and len(experts):
        for e, ex in enumerate(experts):
            names = _gated(ex)
            if names is None:
                raise NotImplementedError(f"{M}.experts.{e} ({type(ex).__name__}) is not a gated MLP of nn.Linear")
            g, u, d = (getattr(ex, k) for k in names)
            p = f"{M}.experts.{e}"
            consumers += [Consumer(f"{p}.{names[0]}", WeightSlice(g)), Consumer(f"{p}.{names[1]}", WeightSlice(u))]
            down_groups.append(SmoothingGroup(f"{p}.{names[2]}", u, (d,), (f"{p}.{names[2]}",), f"{p}.{names[1]}"))
            paths += [f"{p}.{k}" for k in names]
    else:
        raise NotImplementedError(f"{M}.experts ({type(experts).__name__}) is neither fused 3-D experts nor an "
                                  "nn.ModuleList of expert MLPs")
    for sname in _SHARED:
        shared = getattr(block, sname, None)
        if shared is None:
            continue
        names = _gated(shared)
        if names is None:
            raise NotImplementedError(f"{M}.{sname} ({type(shared).__name__}) is not a gated MLP of nn.Linear")
        g, u, d = (getattr(shared, k) for k in names)
        p = f"{M}.{sname}"
        consumers += [Consumer(f"{p}.{names[0]}", WeightSlice(g)), Consumer(f"{p}.{names[1]}", WeightSlice(u))]
        down_groups.append(SmoothingGroup(f"{p}.{names[2]}", u, (d,), (f"{p}.{names[2]}",), f"{p}.{names[1]}"))
        paths += [f"{p}.{k}" for k in names]
    sg = getattr(block, "shared_expert_gate", None)
    if sg is not None:
        if not isinstance(sg, nn.Linear):
            raise NotImplementedError(f"{M}.shared_expert_gate is a {type(sg).__name__}, not nn.Linear")
        consumers.append(Consumer(f"{M}.shared_expert_gate", WeightSlice(sg)))
        paths.append(f"{M}.shared_expert_gate")
    first = MoESmoothingGroup(f"{M}.gate_up", norm2, consumers, "post_attention_layernorm")
    return [first, *down_groups], paths


def find_moe_smoothing_groups(layer: nn.Module) -> tuple[list, list[str]]:
    """The smoothing groups of an MoE (or MLA) decoder layer, in folding order (``SmoothingGroup`` for
    groups of nn.Linear consumers, ``MoESmoothingGroup`` otherwise), and notes on what is left
    unsmoothed. NotImplementedError saying why for any other layout (every parameter of the layer must
    belong to a module whose role is known), ValueError for a norm with NaN/inf weights."""
    norm1, norm2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if norm1 is None or norm2 is None or getattr(layer, "self_attn", None) is None:
        raise NotImplementedError("expected input_layernorm, self_attn and post_attention_layernorm")
    M = next((m for m in _MLP_BLOCKS if getattr(layer, m, None) is not None), None)
    if M is None:
        raise NotImplementedError(f"no MLP block ({' or '.join(_MLP_BLOCKS)})")
    notes: list[str] = []
    attn_groups, attn_paths = _attention_groups(layer, norm1, notes)
    mlp_groups, mlp_paths = _mlp_groups(layer, M, norm2, notes)
    allowed = {"input_layernorm", "post_attention_layernorm", *attn_paths, *mlp_paths}  # modules (or parameters)
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if owner not in allowed and pname not in allowed:
            raise NotImplementedError(f"parameter {pname!r} belongs to no module of the MoE / MLA layout")
    norms = [("input_layernorm", norm1), ("post_attention_layernorm", norm2)]
    norms += [(g.prev_name, g.prev) for g in attn_groups if g.prev_name.endswith("layernorm")
              and g.prev_name != "input_layernorm"]
    for path, norm in norms:
        try:
            check_norm_absorbs_scales(norm)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return [*attn_groups, *mlp_groups], notes


__all__ = ["Consumer", "GPT_OSS_DOWN_NOTE", "MLA_O_PROJ_NOTE", "MoESmoothingGroup", "WeightSlice",
           "find_moe_smoothing_groups", "fold_moe_smoothing", "gpt_oss_expert_output"]
