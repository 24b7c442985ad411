"""What one quantized Linear of a checkpoint is: its ``ModuleScheme`` (weight format + activation
handling, the part a checkpoint's quantization config states) and the in-memory module it becomes.

    NVFP4Linear  -> ModuleScheme("nvfp4", "nvfp4", "nvfp4" | None)        nvfp4-w4a4 / nvfp4-w4a16
    FP8Linear    -> ModuleScheme("fp8", "tensor"|"channel"|"block", None|"tensor"|"token"|"block")
    MXLinear     -> ModuleScheme("mx", "e4m3"|"e2m1", None | the weight element)

What a config cannot state (NVFP4 W4A4 activation rule / error, the MX scale rule the activations
are quantized with) lives in ``ModuleRules``, recorded in ``quantization_config.blockscale``. What
each kind's buffers and modules are: ``tensor_kinds``.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..nn.mx_linear import MXLinear
from ..nn.nvfp4_linear import NVFP4Linear
from ..nn.quantized_linear import QuantizedInferenceLinear
from ..nn.quantized_modules import QUANTIZED_LINEAR_TYPES
from .scheme_types import ModuleRules, ModuleScheme
from .tensor_kinds import TENSOR_KINDS, kind_of

#: the ``ModuleScheme.kind`` values (one per ``tensor_kinds.TensorKind``)
KINDS = tuple(k.name for k in TENSOR_KINDS)


def scheme_of(m: nn.Module) -> ModuleScheme:
    """The scheme of a quantized Linear (NVFP4Linear, FP8Linear, MXLinear): its ``stored`` triple."""
    if isinstance(m, QuantizedInferenceLinear):
        return ModuleScheme(*m.stored)
    names = ", ".join(t.__name__ for t in QUANTIZED_LINEAR_TYPES)
    raise TypeError(f"{type(m).__name__} is not a quantized Linear ({names})")


def rules_of(m: nn.Module) -> ModuleRules:
    if isinstance(m, NVFP4Linear):
        return ModuleRules(m.input_scale_rule, m.input_error)
    if isinstance(m, MXLinear):
        return ModuleRules(scale_rule=m.scale_rule)
    return ModuleRules()


def buffers(scheme: ModuleScheme) -> tuple[str, ...]:
    """The module's quantized buffers (compressed-tensors' on-disk names) for ``scheme``."""
    return kind_of(scheme).buffers(scheme)


def build_module(scheme: ModuleScheme, rules: ModuleRules, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> nn.Module:
    """An empty module of ``scheme`` (its buffers are filled from a checkpoint): the quantized Linear of its
    kind (``nn.QuantizedInferenceLinear.class_for``) with ``rules``."""
    return QuantizedInferenceLinear.class_for(scheme.kind).empty(
        (scheme.kind, scheme.weights, scheme.inputs), in_features, out_features, bias,
        rules=dataclasses.asdict(rules), dtype=dtype)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every NVFP4Linear / FP8Linear / MXLinear of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_LINEAR_TYPES)}


__all__ = ["KINDS", "ModuleRules", "ModuleScheme", "buffers", "build_module", "quantized_modules", "rules_of",
           "scheme_of"]
