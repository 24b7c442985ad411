"""What one quantized Linear of a checkpoint is: its ``ModuleScheme`` (weight format + activation
handling, the part a checkpoint's quantization config states) and the in-memory module it becomes.

    NVFP4Linear  -> ModuleScheme("nvfp4", "nvfp4", "nvfp4" | None)        nvfp4-w4a4 / nvfp4-w4a16
    FP8Linear    -> ModuleScheme("fp8", "tensor"|"channel"|"block", None|"tensor"|"token"|"block")
    MXLinear     -> ModuleScheme("mx", "e4m3"|"e2m1", None | the weight element)

What a config cannot state (NVFP4 W4A4 activation rule / error, the MX scale rule the activations
are quantized with) lives in ``ModuleRules``, recorded in ``quantization_config.blockscale``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..nn.fp8_linear import FP8Linear
from ..nn.mx_linear import MXLinear
from ..nn.nvfp4_linear import NVFP4Linear
from ..nn.quantized_modules import QUANTIZED_LINEAR_TYPES
from ..quant.schemes import stored_scheme_name

KINDS = ("nvfp4", "fp8", "mx")


@dataclass(frozen=True)
class ModuleScheme:
    """kind: "nvfp4" | "fp8" | "mx"; weights: "nvfp4" | FP8 weight granularity ("tensor", "channel",
    "block" = 128x128) | MX element ("e4m3", "e2m1"); inputs: None (weights only) | "nvfp4" | FP8
    input granularity ("tensor" static, "token" / "block" 1x128 dynamic) | the MX element (dynamic per 32)."""

    kind: str
    weights: str
    inputs: Optional[str] = None

    @property
    def name(self) -> str:
        """The scheme name: the row of ``quant.schemes.SCHEME_TABLE`` that stores it (recipes' SCHEME_NAMES,
        plus the weights-only "fp8-w8a16" / "mxfp8-w8a16")."""
        return stored_scheme_name(self.kind, self.weights, self.inputs)

    @property
    def label(self) -> str:
        """The name with what it does not say, e.g. "fp8-w8a8 channel/token", "fp8-block block/token"."""
        if self.kind == "fp8":
            return f"{self.name} {self.weights}/{self.inputs or 'none'}"
        return self.name

    @property
    def is_nvfp4(self) -> bool:
        return self.kind == "nvfp4"


@dataclass(frozen=True)
class ModuleRules:
    """What the config does not say: NVFP4 W4A4 activation ``input_scale_rule`` / ``input_error``,
    the MX ``scale_rule`` (activations of mxfp8 / mxfp4; the stored weights do not depend on it)."""

    input_scale_rule: Optional[str] = None
    input_error: str = "mse"
    scale_rule: str = "ceil"


def scheme_of(m: nn.Module) -> ModuleScheme:
    """The scheme of a quantized Linear (NVFP4Linear, FP8Linear, MXLinear)."""
    if isinstance(m, NVFP4Linear):
        return ModuleScheme("nvfp4", "nvfp4", "nvfp4" if m.input_global_scale is not None else None)
    if isinstance(m, FP8Linear):
        return ModuleScheme("fp8", m.weight_granularity, m.input_granularity)
    if isinstance(m, MXLinear):
        return ModuleScheme("mx", m.element, m.input_element)
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
    if scheme.kind == "nvfp4":
        return ("weight_packed", "weight_scale", "weight_global_scale") + \
            (("input_global_scale",) if scheme.inputs else ())
    if scheme.kind == "fp8":
        return ("weight", "weight_scale") + (("input_scale",) if scheme.inputs == "tensor" else ())
    return ("weight_packed" if scheme.weights == "e2m1" else "weight", "weight_scale")


def build_module(scheme: ModuleScheme, rules: ModuleRules, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> nn.Module:
    """An empty module of ``scheme`` (its buffers are filled from a checkpoint)."""
    if scheme.kind == "nvfp4":
        return NVFP4Linear(in_features, out_features, bias, dtype=dtype,
                           input_scale_rule=(rules.input_scale_rule or "6") if scheme.inputs else None,
                           input_error=rules.input_error if scheme.inputs else "mse")
    if scheme.kind == "fp8":
        return FP8Linear(in_features, out_features, bias, weight_granularity=scheme.weights,
                         input_granularity=scheme.inputs, dtype=dtype)
    return MXLinear(in_features, out_features, bias, element=scheme.weights, input_element=scheme.inputs,
                    scale_rule=rules.scale_rule, dtype=dtype)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every NVFP4Linear / FP8Linear / MXLinear of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_LINEAR_TYPES)}


__all__ = ["KINDS", "ModuleRules", "ModuleScheme", "buffers", "build_module", "quantized_modules", "rules_of",
           "scheme_of"]
