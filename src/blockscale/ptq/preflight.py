"""What PTQ will do to a model, decided and checked before any calibration runs: which Linears of the
decoder layers become NVFP4, what stays in high precision (and its share of the decoder weights),
finite parameters, smoothable layers, calibration token ids inside the vocabulary.

Coverage is counted as ``blockscale.nn.coverage.weight_coverage`` counts it after quantization:
quantized = in_features * out_features of every Linear PTQ converts; high precision = the elements
(and E * 3 * I * H of every fused 3-D experts module it converts, ``ptq.fused_experts``); high
precision = the elements of every other floating-point parameter of >= 2 dims a decoder-layer module
owns (excluded experts, routers, excluded Linears). high_precision_fraction = high / (quantized + high).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import DataError, QuantizationError, UsageError
from ..nn.coverage import Coverage, weight_coverage
from ..nn.fused import fused_groups
from ..nn.experts_layout import has_fused_expert_parameters
from ..nn.experts_layouts import experts_layout_of
from ..quant import format_of
from .config import METHODS, PTQConfig
from .finite import check_finite_parameters, non_finite_error
from .scheme_plan import assign_schemes

# above this share of the decoder-layer weight elements left in high precision, PTQ refuses to call
# the result an NVFP4 model unless PTQConfig.allow_partial
PARTIAL_LIMIT = 0.5


@dataclass
class Plan:
    """per_layer: per decoder layer, full name -> the nn.Linear to quantize; experts: per decoder layer,
    full name -> the fused 3-D experts module to quantize (``ptq.fused_experts``); kept_high_precision:
    decoder-layer modules left in high precision, then the Linears outside the decoder layers;
    coverage: the decoder layers' weight elements after PTQ; warnings: per-Linear notes; schemes:
    full name -> the ``recipes.Scheme`` of every Linear in per_layer (``scheme_plan.assign_schemes``)."""

    per_layer: list[dict[str, nn.Linear]]
    kept_high_precision: list[str]
    coverage: Coverage
    warnings: list[str] = field(default_factory=list)
    schemes: dict = field(default_factory=dict)
    kept_by_recipe: set = field(default_factory=set)
    experts: list = field(default_factory=list)  # per decoder layer: full name -> fused-experts module to quantize
    used_rules: set = field(default_factory=set)  # indices of the recipe rules that chose some module's scheme


def _matches(name: str, patterns) -> bool:
    return any(re.search(p, name) for p in patterns)


def _indivisible(full: str, m: nn.Linear, scheme) -> Optional[str]:
    """Why ``m`` cannot take ``scheme`` (in_features not whole blocks), or None."""
    block = scheme.block_size
    if not block or m.in_features % block == 0:
        return None
    return f"{full}: in_features={m.in_features} is not a multiple of {block}, which {scheme.noun} checkpoints need"


def _choose(model: nn.Module, layer: nn.Module, lprefix: str, config: PTQConfig, warnings: list[str],
            schemes: dict, by_recipe: set, used: set) -> dict[str, nn.Linear]:
    recipe = config.ptq_recipe
    candidates = {}
    for n, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            full = f"{lprefix}.{n}"
            if not _matches(full, recipe.ignore):
                candidates[full] = m
    assigned = assign_schemes(model, list(candidates), recipe, used)  # refuses a split fused group
    chosen = {}
    for full, m in candidates.items():
        scheme = assigned[full]
        if scheme.is_high_precision:  # bf16: kept in high precision, listed in kept_high_precision
            by_recipe.add(full)
            continue
        why = _indivisible(full, m, scheme)
        if why is not None and config.skip_indivisible:
            warnings.append(f"{why.split(', which')[0]}: kept in high precision")
            continue
        if why is not None:
            raise QuantizationError(f"{why}; keep it in high precision with exclude=[...] or skip_indivisible=True")
        chosen[full] = m
        schemes[full] = scheme
    # serving engines load a fused group as one layer: all of it quantized or none
    names = [f"{lprefix}.{n}" for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    for group in fused_groups(names):
        part = [n for n in group if n in chosen]
        if part and len(part) != len(group):
            raise QuantizationError(f"fused modules {group}: only {part} would be quantized (exclude / "
                                    "skip_indivisible keep the others in high precision); serving engines load "
                                    "the group as one layer, so quantize all of them or none")
    return chosen


def _experts_indivisible(full: str, H: int, I: int, scheme, interleaved: bool) -> Optional[str]:
    """Why fused experts of hidden size H / intermediate size I cannot take ``scheme``, or None: NVFP4 needs
    H and I multiples of 16 and MX of 32 (both are some GEMM's inputs); a format whose scale rows cover several
    weight rows (128x128-block FP8: 128) needs I a multiple of them where gate and up are stored as two Linears
    (their rows split on a scale-row boundary; not gpt-oss, whose interleaved gate / up is one Linear)."""
    block = scheme.block_size
    if block and (H % block or I % block):
        return (f"{full}: hidden size {H} / intermediate size {I} is not a multiple of {block}, which {scheme.noun} "
                "checkpoints need")
    spec = scheme.weight_spec
    g = format_of(spec).scale_rows(spec)
    if g > 1 and not interleaved and I % g:
        return (f"{full}: intermediate size {I} is not a multiple of {g}, which {scheme.name} experts need (gate and "
                f"up are stored as two Linears of one expert, split on a {g}-row scale tile)")
    return None


def _choose_experts(model: nn.Module, layer: nn.Module, lprefix: str, config: PTQConfig, warnings: list[str],
                    schemes: dict, by_recipe: set, used: set) -> dict[str, nn.Module]:
    """The fused 3-D experts modules of ``layer`` to quantize (``nn.nvfp4_experts``), each one's scheme in
    ``schemes``. Not ignored by the recipe and a scheme other than bf16 (NVFP4, FP8 or MX): it must have a
    supported layout and sizes (``_experts_indivisible``; QuantizationError naming the module otherwise)."""
    recipe = config.ptq_recipe
    chosen = {}
    for n, m in layer.named_modules():
        if not has_fused_expert_parameters(m):
            continue
        full = f"{lprefix}.{n}"
        if _matches(full, recipe.ignore):
            continue
        scheme = assign_schemes(model, [full], recipe, used)[full]
        if scheme.is_high_precision:
            by_recipe.add(full)
            continue
        keep = "keep it in high precision with exclude=[...] (or a bf16 rule in the recipe)"
        layout = experts_layout_of(m)
        why = layout.why_not(m)
        if why is not None:
            raise QuantizationError(f"{full}: {type(m).__name__} holds fused 3-D expert parameters in a layout PTQ "
                                    f"does not know ({why}); {keep}")
        E, H, I = layout.dims(m)
        why = _experts_indivisible(full, H, I, scheme, layout.interleaved)
        if why is not None:
            if config.skip_indivisible:
                warnings.append(f"{why.split(', which')[0]}: kept in high precision")
                continue
            raise QuantizationError(f"{why}; {keep} or skip_indivisible=True")
        chosen[full] = m
        schemes[full] = scheme
    return chosen


def check_experts_method(method, experts: list) -> None:
    """Before calibrating: a QuantizationError when fused experts would be quantized with a method that
    cannot quantize them yet (``PTQMethod.quantizes_fused_experts``)."""
    names = [n for layer in experts for n in layer]
    if names and not getattr(method, "quantizes_fused_experts", False):
        able = [n for n, cls in METHODS.items() if cls.quantizes_fused_experts]
        raise QuantizationError(f"{names[0]}: method={method.name!r} is not yet supported for fused experts "
                                f"({len(names)} fused-experts module{'s' if len(names) != 1 else ''}); use "
                                f"method={' / '.join(map(repr, able))}, or keep the experts in high precision with "
                                "exclude=[...]")


def plan_quantization(model: nn.Module, layers: nn.ModuleList, prefix: str, config: PTQConfig) -> Plan:
    """The Linears PTQ quantizes (every nn.Linear in the decoder layers not ignored by the recipe and
    not given its "bf16" scheme), each one's scheme, and the coverage that leaves, as
    ``weight_coverage`` will count it afterwards. In_features not in whole blocks of the scheme (16
    NVFP4, 32 MX): kept in high precision with a note when ``skip_indivisible``, else QuantizationError."""
    per_layer, kept, quantized, high, notes, schemes, by_recipe = [], [], {}, {}, [], {}, set()
    experts, used = [], set()
    for i, layer in enumerate(layers):
        lprefix = f"{prefix}.{i}"
        chosen = _choose(model, layer, lprefix, config, notes, schemes, by_recipe, used)
        chosen_experts = _choose_experts(model, layer, lprefix, config, notes, schemes, by_recipe, used)
        cov = weight_coverage(layer, lprefix)
        layer_high = {n: v for n, v in cov.high_precision.items() if n not in chosen and n not in chosen_experts}
        quantized.update(cov.quantized)
        quantized.update({n: m.in_features * m.out_features for n, m in chosen.items()})
        quantized.update({n: m.gate_up_proj.numel() + m.down_proj.numel() for n, m in chosen_experts.items()})
        high.update(layer_high)
        kept.extend(layer_high)
        per_layer.append(chosen)
        experts.append(chosen_experts)
    in_layers = {id(m) for d in per_layer for m in d.values()}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and id(m) not in in_layers and n not in kept:
            kept.append(n)
    return Plan(per_layer, kept, Coverage(quantized, high), notes, schemes, by_recipe, experts, used)


def fused_experts_to_quantize(model: nn.Module, config: PTQConfig) -> list[str]:
    """The fused 3-D experts modules ``quantize_model(model, config)`` would quantize (names), from its plan."""
    from .capture import decoder_layers

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return [n for layer in plan_quantization(model, layers, prefix, config).experts for n in layer]


def _largest(high: dict[str, int], k: int = 3) -> str:
    """'N module(s): a (x elements), b (y elements), ...', the largest first."""
    top = sorted(high.items(), key=lambda kv: -kv[1])
    s = ", ".join(f"{n} ({v} elements)" for n, v in top[:k])
    return f"{len(high)} module{'s' if len(high) != 1 else ''}: {s}" + (", ..." if len(high) > k else "")


def coverage_line(coverage: Coverage) -> str:
    """One line: the share of the decoder layers' weight elements left in high precision, and where."""
    hp, total = coverage.high_precision_elements, coverage.quantized_elements + coverage.high_precision_elements
    return (f"{100 * coverage.high_precision_fraction:.1f}% of the decoder layers' weight elements "
            f"({hp} of {total}) stay in high precision, in {_largest(coverage.high_precision)}")


def check_coverage(coverage: Coverage, config: PTQConfig, kept_by_recipe=frozenset()) -> Optional[str]:
    """The warning line when anything in the decoder layers stays in high precision (None otherwise);
    QuantizationError when more than half of it would, unless ``config.allow_partial``. Linears the
    recipe keeps on purpose (its "bf16" scheme, ``kept_by_recipe``) are listed but do not count
    towards the refusal."""
    if not coverage.high_precision:
        return None
    unintended = {n: v for n, v in coverage.high_precision.items() if n not in kept_by_recipe}
    hp = sum(unintended.values())
    total = coverage.quantized_elements + coverage.high_precision_elements
    if total and hp / total > PARTIAL_LIMIT and not config.allow_partial:
        raise QuantizationError(
            f"{100 * hp / total:.1f}% of the decoder layers' weight elements ({hp} of {total}) "
            f"would stay in high precision, in {_largest(unintended)} (PTQ quantizes the nn.Linear "
            "layers and fused 3-D experts not excluded or skipped; routers and other parameters stay as they "
            "are), so the result would hardly be a quantized model; pass allow_partial=True (--allow-partial) to quantize "
            "the rest anyway")
    return coverage_line(coverage)


def check_layers(layers: nn.ModuleList, prefix: str, config: PTQConfig) -> None:
    """The method's own check of every decoder layer (``PTQMethod.check_layer``: e.g. AWQ / SmoothQuant
    fold scales into each layer's norms and Linears), a QuantizationError naming the layer."""
    method = config.make_method()
    for i, layer in enumerate(layers):
        method.check_layer(layer, f"{prefix}.{i}")


def check_method_schemes(method, schemes: dict) -> None:
    """The method's check of every Linear's scheme (``PTQMethod.check_scheme``), before calibrating."""
    for name, scheme in schemes.items():
        method.check_scheme(name, scheme)


def vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the model's input embedding: ``get_input_embeddings()``, else ``config.vocab_size``,
    else its only nn.Embedding; None when none of these is known."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb.num_embeddings
    n = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embs[0].num_embeddings if len(embs) == 1 else None


def check_calibration(model: nn.Module, calibration, config: PTQConfig) -> None:
    """Calibration ids: a non-empty [n, T] long tensor of ids in [0, vocabulary size)."""
    if calibration is None:
        what = (f"recipe={config.recipe.name!r} (static activation scales or a KV cache)" if config.recipe is not None
                else f"activations={config.activations!r}")
        raise UsageError(f"method={config.method!r} with {what} needs calibration token ids (calibration=[n, T] "
                         "tensor)")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        what = (f"{tuple(calibration.shape)} {calibration.dtype}" if isinstance(calibration, torch.Tensor)
                else type(calibration).__name__)
        raise DataError(f"calibration must be a [n, T] long tensor, got {what}")
    n, t = calibration.shape
    if n == 0 or t == 0:
        raise DataError(f"calibration has shape ({n}, {t}): need at least one sequence of at least one token")
    vocab = vocab_size(model)
    if vocab is not None:
        lo, hi = int(calibration.min()), int(calibration.max())
        if lo < 0 or hi >= vocab:
            raise DataError(f"calibration token ids must be in [0, {vocab}) (the model's vocabulary size is "
                            f"{vocab}); got min {lo}, max {hi}")


__all__ = ["PARTIAL_LIMIT", "Plan", "check_calibration", "check_coverage", "check_experts_method",
           "check_finite_parameters",
           "check_layers", "check_method_schemes", "coverage_line", "fused_experts_to_quantize", "non_finite_error",
           "plan_quantization", "vocab_size"]
