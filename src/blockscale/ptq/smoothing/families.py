"""The smoothing groups of each decoder-layer family, kept as data (``SMOOTHING_FAMILIES``).

A family lists its decoder layer classes (and, for the docs, the ``config.model_type`` values that use
them) and its groups as ``GroupRule``s: the producer's path in the layer, the consumers' paths, and how
1 / s is folded into the producer:

  "norm"           a norm computing f(x) * weight (+ bias): weight (and bias) / s
  "norm_plus_one"  Gemma's RMSNorm f(x) * (1 + weight): weight' = (1 + weight) / s - 1
  "linear"         an nn.Linear: its output rows (and bias) / s; with ``rows=(i, n)`` only the i-th of n
                   equal row blocks (Phi-3's fused qkv_proj value rows, gate_up_proj up rows)

``find_smoothing_groups(layer)`` looks the layer's class up in the table (layers of a class no family
lists: matched by module names against the families marked ``by_structure``, as before the table) and
builds the groups, checking that every consumer is an nn.Linear, that every parameter of the layer
belongs to a producer, a consumer or a module the family knows to leave alone (``others``: Gemma's
post-attention / post-feedforward norms act on the block outputs, q_norm / k_norm on heads), and that
each norm really folds the way its rule says (``check_norm_absorbs_scales`` probes it). MoE families
(``moe=True``) are routed to ``moe.find_moe_smoothing_groups``, which derives the groups from the layer's
experts; ``layer_smoothing_groups`` gives either kind. Anything else: NotImplementedError naming the
layer class, the families tried and how to build ``SmoothingGroup``s by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from .groups import SmoothingGroup, check_norm_absorbs_scales
from .moe import find_moe_smoothing_groups
from .slices import WeightSlice

FOLDS = ("norm", "norm_plus_one", "linear")
_OFFSET = {"norm": 0.0, "norm_plus_one": 1.0}
BY_HAND = ("build SmoothingGroup(name, prev, linears, linear_names, prev_name, norm_offset) objects by hand "
           "(blockscale.ptq.smoothing; docs/ptq.md \"Smoothing groups by family\") and fold them with "
           "fold_smoothing, or use method='rtn' / 'gptq'")


@dataclass(frozen=True)
class GroupRule:
    """One smoothing group of a family: ``prev`` (a path in the decoder layer) produces the input of
    ``consumers`` (paths of nn.Linear); ``fold`` is one of ``FOLDS``. ``rows=(i, n)``: with fold "linear",
    only the i-th of n equal blocks of prev's output rows feeds the consumers (K rows each: prev must have
    n * K outputs). ``optional``: skip the group, rather than refuse the layer, when prev's outputs do not
    match the consumers' K (v_proj -> o_proj under grouped-query attention)."""

    name: str
    prev: str
    consumers: tuple[str, ...]
    fold: str = "norm"
    rows: Optional[tuple[int, int]] = None
    optional: bool = False

    def __post_init__(self):
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if self.fold not in FOLDS:
            raise ValueError(f"GroupRule {self.name!r}: fold={self.fold!r}; allowed: {', '.join(FOLDS)}")
        if not self.consumers:
            raise ValueError(f"GroupRule {self.name!r}: needs at least one consumer")
        if self.rows is not None:
            i, n = self.rows
            if self.fold != "linear" or not (0 <= i < n):
                raise ValueError(f"GroupRule {self.name!r}: rows={self.rows!r} needs fold='linear' and 0 <= i < n")


@dataclass(frozen=True)
class SmoothingFamily:
    """A family of decoder layers with the same smoothing groups. layer_classes: the decoder layer class
    names; model_types: the ``config.model_type`` values using them (documentation); rules: the groups in
    folding order; others: modules with parameters that no group touches (left as they are); by_structure:
    also used for layers of an unlisted class that have exactly these modules; moe: the groups come from
    ``moe.find_moe_smoothing_groups`` (rules empty)."""

    name: str
    kind: str
    layer_classes: tuple[str, ...]
    model_types: tuple[str, ...] = ()
    rules: tuple[GroupRule, ...] = ()
    others: tuple[str, ...] = ()
    by_structure: bool = False
    moe: bool = False


def _dense(attn="self_attn", mlp="mlp", norm1="input_layernorm", norm2="post_attention_layernorm", fold="norm",
           names=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           groups=("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")) -> tuple[GroupRule, ...]:
    """The four groups of a gated-MLP decoder layer with separate q/k/v and gate/up Linears."""
    q, k, v, o, g, u, d = names
    return (GroupRule(groups[0], norm1, (f"{attn}.{q}", f"{attn}.{k}", f"{attn}.{v}"), fold),
            GroupRule(groups[1], f"{attn}.{v}", (f"{attn}.{o}",), "linear", optional=True),
            GroupRule(groups[2], norm2, (f"{mlp}.{g}", f"{mlp}.{u}"), fold),
            GroupRule(groups[3], f"{mlp}.{u}", (f"{mlp}.{d}",), "linear"))


_GEMMA = _dense(norm2="pre_feedforward_layernorm", fold="norm_plus_one")
_MOE_CLASSES = ("MixtralDecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer", "OlmoeDecoderLayer",
                "DeepseekV3DecoderLayer", "GptOssDecoderLayer")

SMOOTHING_FAMILIES = (
    SmoothingFamily("llama", "Llama-style (q/k/v/o_proj, gate/up/down_proj, RMSNorm)",
                    ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"),
                    ("llama", "mistral", "qwen2", "qwen3"), _dense(),
                    others=("self_attn.q_norm", "self_attn.k_norm"), by_structure=True),
    SmoothingFamily("gemma", "Gemma (Llama-style with x * (1 + weight) RMSNorm)", ("GemmaDecoderLayer",),
                    ("gemma",), _dense(fold="norm_plus_one")),
    SmoothingFamily("gemma2", "Gemma 2 (sandwich norms, x * (1 + weight) RMSNorm, GeGLU)", ("Gemma2DecoderLayer",),
                    ("gemma2",), _GEMMA, others=("post_attention_layernorm", "post_feedforward_layernorm")),
    SmoothingFamily("gemma3", "Gemma 3 (Gemma 2 with q_norm / k_norm)", ("Gemma3DecoderLayer",),
                    ("gemma3", "gemma3_text"), _GEMMA,
                    others=("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_norm",
                            "self_attn.k_norm")),
    SmoothingFamily("phi3", "Phi-3 (fused qkv_proj and gate_up_proj)", ("Phi3DecoderLayer",), ("phi3",), (
        GroupRule("self_attn.qkv", "input_layernorm", ("self_attn.qkv_proj",)),
        GroupRule("self_attn.o_proj", "self_attn.qkv_proj", ("self_attn.o_proj",), "linear", rows=(2, 3),
                  optional=True),  # q, k, v rows of equal size: no grouped-query attention
        GroupRule("mlp.gate_up", "post_attention_layernorm", ("mlp.gate_up_proj",)),
        GroupRule("mlp.down_proj", "mlp.gate_up_proj", ("mlp.down_proj",), "linear", rows=(1, 2)))),
    SmoothingFamily("blockscale-llama", "blockscale.models.llama.TransformerBlock", ("TransformerBlock",), (),
                    _dense("attention", "feed_forward", "attention_norm", "ffn_norm",
                           names=("wq", "wk", "wv", "wo", "w1", "w3", "w2"),
                           groups=("attention.qkv", "attention.wo", "feed_forward.w1_w3", "feed_forward.w2")),
                    by_structure=True),
    SmoothingFamily("moe", "MoE / MLA layout", _MOE_CLASSES,
                    ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"), by_structure=True,
                    moe=True),
)


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def smoothing_family(layer: nn.Module) -> Optional[SmoothingFamily]:
    """The family listing ``type(layer).__name__``, or None."""
    cls = type(layer).__name__
    return next((f for f in SMOOTHING_FAMILIES if cls in f.layer_classes), None)


def _match(layer: nn.Module, fam: SmoothingFamily) -> Optional[str]:
    """None if ``layer`` has the modules of ``fam``'s rules (and no parameter outside them), else why not."""
    paths = []
    for r in fam.rules:
        for path in (r.prev, *r.consumers):
            if _get(layer, path) is None:
                return f"no submodule {path!r}"
            paths.append(path)
        for path in (*r.consumers, *((r.prev,) if r.fold == "linear" else ())):
            if not isinstance(_get(layer, path), nn.Linear):
                return f"{path!r} is a {type(_get(layer, path)).__name__}, not nn.Linear"
    allowed = {*paths, *fam.others}
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if owner not in allowed:
            return f"parameter {pname!r} belongs to no module of this family's groups"
    return None


def _build(layer: nn.Module, fam: SmoothingFamily) -> list[SmoothingGroup]:
    cls = type(layer).__name__
    for path in dict.fromkeys(r.prev for r in fam.rules if r.fold != "linear"):
        rule = next(r for r in fam.rules if r.prev == path)
        try:
            check_norm_absorbs_scales(_get(layer, path), _OFFSET[rule.fold])
        except NotImplementedError as err:
            raise NotImplementedError(f"find_smoothing_groups({cls}): {err}") from None
        except ValueError as err:
            raise ValueError(f"find_smoothing_groups({cls}): {path}: {err}") from None
    groups = []
    for r in fam.rules:
        prev, linears = _get(layer, r.prev), tuple(_get(layer, p) for p in r.consumers)
        K = linears[0].in_features
        if r.fold == "linear":
            i, n = r.rows or (0, 1)
            if prev.out_features != n * K:
                if r.optional:
                    continue
                have = f"{prev.out_features} outputs" + (f" (not {n} blocks of {K})" if r.rows else "")
                raise NotImplementedError(f"find_smoothing_groups({cls}): {r.prev} has {have} but "
                                          f"{r.consumers[0]} {K} inputs")
            if r.rows is not None:
                prev = WeightSlice(prev, rows=(i * K, (i + 1) * K))
        groups.append(SmoothingGroup(r.name, prev, linears, r.consumers, r.prev, _OFFSET.get(r.fold, 0.0)))
    return groups


def _unsupported(layer: nn.Module, reasons: list[str]) -> NotImplementedError:
    cls = type(layer).__name__
    listed = ", ".join(c for f in SMOOTHING_FAMILIES for c in f.layer_classes)
    return NotImplementedError(f"find_smoothing_groups: {cls} is not a supported decoder layer ("
                               + "; ".join(reasons) + f"). Supported decoder layers: {listed} (and layers of other "
                               f"classes with the modules of the Llama-style, TransformerBlock or MoE layouts); "
                               f"for another architecture {BY_HAND}")


def _dense_groups(layer: nn.Module, reasons: list[str]) -> Optional[list[SmoothingGroup]]:
    """The groups of a dense family: the listed one, else the first by_structure one that matches."""
    fam = smoothing_family(layer)
    fams = [fam] if fam is not None else [f for f in SMOOTHING_FAMILIES if f.by_structure and not f.moe]
    if fam is None:
        reasons.append(f"no smoothing family lists the class {type(layer).__name__}")
    for f in fams:
        why = _match(layer, f)
        if why is None:
            return _build(layer, f)
        reasons.append(f"family {f.name!r} ({f.kind}): {why}")
    return None


def find_smoothing_groups(layer: nn.Module) -> list[SmoothingGroup]:
    """The smoothing groups of one dense decoder layer, in the order AWQ processes them (the families of
    ``SMOOTHING_FAMILIES`` without ``moe``; their groups are tabled in docs/ptq.md). For Llama-style
    layers (Llama, Mistral, Qwen2, Qwen3) and ``blockscale.models.llama.TransformerBlock``:

      input_layernorm          -> q_proj, k_proj, v_proj     "self_attn.qkv"
      v_proj                   -> o_proj                     "self_attn.o_proj"  (only without GQA)
      post_attention_layernorm -> gate_proj, up_proj         "mlp.gate_up"
      up_proj                  -> down_proj                  "mlp.down_proj"

    Gemma 2 / 3: the same with pre_feedforward_layernorm feeding gate/up, every norm folded as
    (1 + weight) / s - 1; Phi-3: input_layernorm -> qkv_proj, qkv_proj's value rows -> o_proj (without
    GQA), post_attention_layernorm -> gate_up_proj, gate_up_proj's up rows -> down_proj.

    v_proj -> o_proj is skipped when v_proj's outputs do not match o_proj's inputs (grouped-query
    attention repeats each value head, so one scale per o_proj input cannot be folded into v_proj), as
    AWQ does. The up -> down fold is exact for the gated MLP ``down(act(gate(x)) * up(x))`` (any act:
    SiLU, GELU-tanh). MoE layers: ``layer_smoothing_groups``. Raises NotImplementedError naming the layer
    class for any other layer (and for a norm that does not fold the way its family says).
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module, got {type(layer).__name__}")
    fam = smoothing_family(layer)
    if fam is not None and fam.moe:
        raise NotImplementedError(f"find_smoothing_groups: {type(layer).__name__} is an MoE / MLA decoder layer "
                                  "(family 'moe'); its groups (MoESmoothingGroup too) come from "
                                  "layer_smoothing_groups")
    reasons: list[str] = []
    groups = _dense_groups(layer, reasons)
    if groups is None:
        raise _unsupported(layer, reasons)
    return groups


def layer_smoothing_groups(layer: nn.Module) -> tuple[list, list[str]]:
    """The groups of any decoder layer smoothing supports (dense families: ``find_smoothing_groups``; MoE /
    MLA layers: ``find_moe_smoothing_groups``), with the notes on what stays unsmoothed.
    NotImplementedError naming the layer class and every reason otherwise."""
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module, got {type(layer).__name__}")
    fam = smoothing_family(layer)
    reasons: list[str] = []
    if fam is None or not fam.moe:
        groups = _dense_groups(layer, reasons)
        if groups is not None:
            return groups, []
        if fam is not None:
            raise _unsupported(layer, reasons)
    try:
        return find_moe_smoothing_groups(layer)
    except NotImplementedError as err:
        reasons.append(f"family 'moe': MoE / MLA layout: {err}")
    raise _unsupported(layer, reasons)


__all__ = ["BY_HAND", "FOLDS", "GroupRule", "SMOOTHING_FAMILIES", "SmoothingFamily", "find_smoothing_groups",
           "layer_smoothing_groups", "smoothing_family"]
