"""``rotate_model``: apply a ``RotationPlan`` to a causal LM before PTQ.

Fused rotations (computed in FP64, rounded once to each weight's dtype; the full-precision function is
unchanged up to that rounding):

  R1  residual stream, ``Q1`` = random Hadamard over the largest power-of-two block of the hidden size.
      Every RMSNorm's weight g is folded into the Linears it feeds (W <- W diag(g), g <- 1; Gemma's
      ``1 + g``: g <- 0), then those Linears take W <- W Q1 (their input is rotated), the Linears writing
      the residual stream (o_proj, down_proj) W <- Q1^T W (and bias), the embeddings E <- E Q1, the final
      norm folds into lm_head, lm_head W <- W Q1 (untied from the embeddings first: a tied pair cannot take
      both). RMSNorm commutes with an orthogonal Q once its weight is 1: rms(x Q) = rms(x).
  R2  per attention head, ``Q2`` = random Hadamard of size head_dim (seed + 1): v_proj's output rows
      W_v <- Q2^T W_v per head, o_proj's input columns W_o <- W_o Q2 per head. Grouped-query attention is
      fine: every value head takes the same Q2.

Online rotations (``nn.input_rotation``: a forward pre-hook ``x -> x Q`` and W <- W Q fused):

  R3  the post-RoPE queries and keys, Sylvester Hadamard over head_dim (``keys``: only the KV cache's key
      quantization sees it).
  R4  down_proj's input, Sylvester Hadamard over the largest power-of-two block of intermediate_size.
  quip / block:N / mr  every decoder Linear's input (q/k/v/o, gate/up/down), one block size per Linear.

Everything is checked before any weight changes (no half-rotated model). Supported: dense decoder layers of
the smoothing families with RMSNorm (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, blockscale's own Llama);
R1 refuses Gemma 2 / 3 (their sandwich norms act on the residual branch outputs with non-uniform weights,
which do not commute with Q1); MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss; ``experts``): R1 also
folds the post-attention norm into the router, every routed expert's gate_up and the shared expert (and
shared_expert_gate), and rotates every expert's down_proj output rows (gpt-oss: its bias too); the router's logits
are unchanged, so R1 commutes with routing. R2 is attention-only. Online rotations rotate only the dense Linears
(attention, the shared expert); the routed experts stay unrotated (listed in ``RotationReport.skipped``), the router
and shared_expert_gate are never rotated online. MLA layers (DeepSeek-V2 / V3) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ...errors import QuantizationError
from ...nn.input_rotation import attach_input_rotation, input_rotation
from ...quant import MX, NVFP4
from ...quant.transforms.rotation import Rotation, largest_power_of_two_divisor, rotation
from ..capture import decoder_layers
from ..smoothing import find_smoothing_groups, smoothing_family
from ..smoothing.slices import WeightSlice
from .keys import apply_key_rotations, key_rotation_targets
from .experts import MoEParts, finish_moe_layer, fold_moe_r1, moe_layer, moe_unrotated  # MoE layers
from .plan import RotationPlan

_NORM_FOLDS = {0.0: 1.0, 1.0: 0.0}  # norm_offset -> the weight value that makes offset + weight == 1


@dataclass
class RotationReport:
    """What ``rotate_model`` did: ``plan`` (its label), ``fused`` lines (one per fused rotation),
    ``online`` {group: (rotation description, module count)}, ``untied`` (lm_head untied from the
    embeddings), ``skipped`` (Linears the plan left unrotated, with why)."""

    plan: str
    fused: list[str] = field(default_factory=list)
    online: dict[str, tuple[str, int]] = field(default_factory=dict)
    untied: bool = False
    skipped: list[str] = field(default_factory=list)
    keys: Optional[tuple[str, int]] = None  # R3: (rotation description, attention module count)

    def lines(self) -> list[str]:
        out = [f"rotate {self.plan}:"] + [f"  fused {f}" for f in self.fused]
        out += [f"  online {g}: {d} on {n} Linear input(s)" for g, (d, n) in self.online.items()]
        if self.keys is not None:
            out.append(f"  online R3: {self.keys[0]} on the post-RoPE queries and keys of {self.keys[1]} attention "
                       "module(s) (changes only a quantized KV cache)")
        if self.untied:
            out.append("  lm_head untied from the embeddings")
        out += [f"  unrotated {s}" for s in self.skipped]
        return out


@dataclass
class _Layer:
    """One decoder layer's structure: norm groups (norm, offset, consumer Linears), residual writers,
    the value rows / o_proj / head_dim for R2, every Linear by name."""

    index: int
    prefix: str
    norms: list[tuple[nn.Module, float, list[nn.Linear]]]
    writers: list[nn.Linear]
    linears: dict[str, nn.Linear]
    value: Optional[tuple[nn.Linear, int, int]] = None  # (Linear, first row, rows)
    out_proj: Optional[nn.Linear] = None
    head_dim: Optional[int] = None
    down: Optional[nn.Linear] = None
    moe: Optional[MoEParts] = None  # MoE layers: routers / fused experts (experts.py)


def _norm_weight(norm: nn.Module, name: str) -> nn.Parameter:
    w = getattr(norm, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        raise QuantizationError(f"{name}: rotation R1 needs an RMSNorm with a 1-D weight, found {type(norm).__name__}")
    if getattr(norm, "bias", None) is not None or "rmsnorm" not in type(norm).__name__.lower():
        raise QuantizationError(f"{name}: rotation R1 needs RMSNorm (no mean subtraction, no bias); "
                                f"{type(norm).__name__} does not commute with a rotation")
    return w


def _analyse(layer: nn.Module, index: int, prefix: str, plan: RotationPlan) -> _Layer:
    where = f"{prefix}.{index}"
    fam = smoothing_family(layer)
    moe = None
    if fam is not None and fam.moe:  # MoE layers (MLA refused): experts.py
        groups, moe = moe_layer(layer, where)
    else:
        try:
            groups = find_smoothing_groups(layer)
        except (NotImplementedError, ValueError) as err:
            raise QuantizationError(f"{where}: rotations need a decoder layer of a known family: {err}") from err
    if plan.r1 and fam is not None and fam.name in ("gemma2", "gemma3"):
        raise QuantizationError(f"{where}: rotation R1 does not commute with {type(layer).__name__}'s sandwich norms "
                                "(post-attention / post-feedforward RMSNorm weights act on the residual branch); "
                                "use r4, quip, block:N or mr")
    names = {id(m): n for n, m in layer.named_modules()}
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    norms, consumers = [], set()
    for g in groups:
        if isinstance(g.prev, WeightSlice) or isinstance(g.prev, nn.Linear):
            continue
        norms.append((g.prev, g.norm_offset, list(g.linears)))
        consumers.update(id(m) for m in g.linears)
    writers = [m for m in linears.values() if id(m) not in consumers]
    info = _Layer(index, where, norms, writers, linears)
    attn_group = next((g for g in groups if not isinstance(g.prev, (nn.Linear, WeightSlice))), None)
    out_names = [names[id(w)] for w in writers]
    info.out_proj = next((w for w in writers if names[id(w)].endswith(("o_proj", "wo"))), None)
    info.down = next((w for w in writers if names[id(w)].endswith(("down_proj", "w2"))), None)
    if moe is not None:  # MoE: R1's writers checked, routers / routed experts out of info.linears (experts.py)
        finish_moe_layer(info, moe, plan)
    elif plan.r1:
        hidden = norms[0][2][0].in_features if norms else None
        bad = [n for n, w in zip(out_names, writers) if w.out_features != hidden]
        if bad or len(writers) != 2:
            raise QuantizationError(f"{where}: rotation R1 expects two Linears writing the residual stream "
                                    f"(o_proj, down_proj), found {out_names}")
    if plan.r2:
        attn = next((m for n, m in layer.named_modules() if n.endswith(("self_attn", "attention"))), None)
        hd = getattr(attn, "head_dim", None)
        if not isinstance(hd, int) or hd < 2 or hd & (hd - 1):
            raise QuantizationError(f"{where}: rotation R2 needs a power-of-two head_dim on the attention module, "
                                    f"found {hd!r}")
        cons = attn_group.linears if attn_group is not None else ()
        if len(cons) == 3:
            info.value = (cons[2], 0, cons[2].out_features)
        elif len(cons) == 1 and info.out_proj is not None:  # fused qkv_proj: the value rows come last
            kv_rows = (cons[0].out_features - info.out_proj.in_features) // 2
            info.value = (cons[0], cons[0].out_features - kv_rows, kv_rows)
        if info.value is None or info.out_proj is None:
            raise QuantizationError(f"{where}: rotation R2 could not find v_proj and o_proj")
        info.head_dim = hd
    if plan.r4 and info.down is None and moe is None:  # MoE: R4 on the shared expert's down_proj, if any
        raise QuantizationError(f"{where}: rotation R4 could not find down_proj")
    return info


def _fold_norm_then_rotate(lin: nn.Linear, gamma: torch.Tensor, offset: float, q: Optional[Rotation]) -> None:
    w = lin.weight.detach().to(torch.float64) * (offset + gamma.detach().to(torch.float64))
    out = q.fold_input(w) if q is not None else w
    lin.weight.data = out.to(lin.weight.dtype)


def _fold_output_rows(lin: nn.Linear, q: Rotation, first: int = 0, rows: Optional[int] = None) -> None:
    rows = lin.out_features - first if rows is None else rows
    w = lin.weight.data
    w[first:first + rows] = q.fold_output(w[first:first + rows])
    if lin.bias is not None:
        b = lin.bias.data
        b[first:first + rows] = q.fold_output(b[first:first + rows].unsqueeze(-1)).squeeze(-1)


def _fused(plan: RotationPlan, size: int, seed: int) -> Rotation:
    """R1 / R2's rotation: random Hadamard ``diag(s) H``, or with online input rotations in the plan its transpose
    ``H diag(s)``: the online Sylvester blocks would otherwise cancel the fused one's Sylvester factor
    (``diag(s) H_64 blockdiag(H_16) = 16 diag(s) (H_4 x I_16)``: R1 + mr would mix only 4 channels, R1 + quip none)."""
    q = rotation(plan.fused_kind, size, seed)
    return q.transposed() if plan.inputs is not None else q


def _untie(model: nn.Module, head: nn.Module, embed: nn.Module) -> bool:
    if head.weight is not embed.weight and head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
        cfg.tie_word_embeddings = False
    return True


def _input_blocks(plan: RotationPlan, infos: list[_Layer], schemes: Optional[dict]) -> dict[int, tuple[str, int]]:
    """{id(Linear): (name, block size)} of the online input rotation of every decoder Linear."""
    out = {}
    for info in infos:
        for rel, lin in info.linears.items():
            name = f"{info.prefix}.{rel}"
            if plan.inputs == "full":
                n = largest_power_of_two_divisor(lin.in_features)
            elif plan.inputs == "group":
                spec = getattr((schemes or {}).get(name), "weight_spec", None)
                n = spec.block_size if isinstance(spec, (NVFP4, MX)) else None  # 16 / 32; others: unrotated
            else:
                n = plan.inputs
            out[id(lin)] = (name, n)
    return out


def _r1_modules(model: nn.Module, prefix: str, infos: list[_Layer]):
    """(embeddings, lm_head, final norm) for R1, checked (QuantizationError otherwise)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    parent = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
    final_norm = getattr(parent, "norm", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or final_norm is None:
        raise QuantizationError("rotation R1 needs nn.Embedding input embeddings, an nn.Linear lm_head and a "
                                f"final norm next to the decoder layers ({prefix.rpartition('.')[0]}.norm)")
    _norm_weight(final_norm, "final norm")
    for info in infos:
        for k, (norm, _, _) in enumerate(info.norms):
            _norm_weight(norm, f"{info.prefix} norm {k}")
    return embed, head, final_norm


def _apply_r1(model, infos, embed, head, final_norm, q1: Rotation, report: RotationReport) -> None:
    report.untied = _untie(model, head, embed)
    embed.weight.data = q1.fold_input(embed.weight.data)
    for info in infos:
        if info.moe is not None:  # MoE: router, fused experts (experts.py), before the norm weight is reset
            fold_moe_r1(info.moe, q1)
        for norm, offset, cons in info.norms:
            for lin in cons:
                _fold_norm_then_rotate(lin, norm.weight, offset, q1)
            norm.weight.data.fill_(_NORM_FOLDS.get(offset, 1.0 - offset))
        for w in info.writers:
            _fold_output_rows(w, q1)
    off = 1.0 if type(final_norm).__name__.lower().startswith("gemma") else 0.0
    _fold_norm_then_rotate(head, final_norm.weight, off, q1)
    final_norm.weight.data.fill_(_NORM_FOLDS.get(off, 1.0 - off))
    report.fused.append(f"R1 {q1.describe()} on the residual stream ({len(infos)} layers, embeddings, lm_head; "
                        "norm weights folded)")


def _apply_r2(infos, plan: RotationPlan, report: RotationReport) -> None:
    rots: dict[int, Rotation] = {}
    for info in infos:
        q2 = rots.setdefault(info.head_dim, _fused(plan, info.head_dim, plan.seed + 1))
        lin, first, rows = info.value
        _fold_output_rows(lin, q2, first, rows)
        info.out_proj.weight.data = q2.fold_input(info.out_proj.weight.data)
    report.fused += [f"R2 {q.describe()} per attention head (v_proj rows, o_proj columns)" for q in rots.values()]


def _online(infos, plan: RotationPlan, blocks: dict, report: RotationReport) -> list[tuple[nn.Linear, str, int]]:
    """(Linear, group, block size) of every online rotation the plan asks for; Linears left out in ``report``."""
    online = [(info.down, "R4", largest_power_of_two_divisor(info.down.in_features)) for info in infos
              if info.down is not None] if plan.r4 else []
    report.skipped += moe_unrotated(infos, plan)  # MoE: routed experts (and routers) left unrotated
    for info in infos:
        for lin in info.linears.values():
            if id(lin) in blocks:
                name, n = blocks[id(lin)]
                if n is None:
                    report.skipped.append(f"{name} (high precision, or its scheme has no 16 / 32 quantization group)")
                else:
                    online.append((lin, "v", n))
    return online


def _apply_online(online, plan: RotationPlan, report: RotationReport) -> None:
    sizes: dict[str, set] = {}
    for _, g, n in online:
        sizes.setdefault(g, set()).add(n)
    cache: dict[int, Rotation] = {}
    for lin, g, n in online:
        q = cache.setdefault(n, rotation(plan.online_kind, n, plan.seed))
        group = g if len(sizes[g]) == 1 else f"{g}{n}"
        lin.weight.data = q.fold_input(lin.weight.data)
        attach_input_rotation(lin, q, group)
        desc, count = report.online.get(group, (q.describe(), 0))
        report.online[group] = (desc, count + 1)


def _check_blocks(infos, blocks: dict) -> None:
    for info in infos:
        for lin in info.linears.values():
            if input_rotation(lin) is not None:
                raise QuantizationError(f"{info.prefix}: {type(lin).__name__} already has an online input rotation "
                                        "(rotated twice?)")
            name, n = blocks.get(id(lin), (None, None))
            if n is not None and lin.in_features % n:
                raise QuantizationError(f"{name}: in_features {lin.in_features} is not a multiple of the rotation "
                                        f"block {n}")


@torch.no_grad()
def rotate_model(model: nn.Module, plan: RotationPlan, schemes: Optional[dict] = None) -> RotationReport:
    """Apply ``plan`` to ``model`` in place (see the module docstring). ``schemes``: {Linear name: scheme}
    (``ptq.scheme_plan``), needed for ``inputs="group"`` (mr). Raises QuantizationError, before changing
    anything, for a model the plan cannot rotate."""
    report = RotationReport(plan.label)
    if not plan.any:
        return report
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    infos = [_analyse(layer, i, prefix, plan) for i, layer in enumerate(layers)]
    blocks = _input_blocks(plan, infos, schemes) if plan.inputs is not None else {}
    _check_blocks(infos, blocks)
    r3_targets = key_rotation_targets(layers, prefix) if plan.r3 else []
    if plan.r1:
        embed, head, final_norm = _r1_modules(model, prefix, infos)
        q1 = _fused(plan, largest_power_of_two_divisor(embed.weight.shape[1]), plan.seed)
        _apply_r1(model, infos, embed, head, final_norm, q1, report)
    if plan.r2:
        _apply_r2(infos, plan, report)
    _apply_online(_online(infos, plan, blocks, report), plan, report)
    if r3_targets:
        report.keys = apply_key_rotations(r3_targets, plan.online_kind, plan.seed)
    return report
