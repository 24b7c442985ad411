"""The record of one quantized Linear's scheme as a checkpoint states it (``ModuleScheme``) and what a
config cannot state (``ModuleRules``); ``module_schemes`` re-exports both with the functions around them.

    NVFP4Linear  -> ModuleScheme("nvfp4", "nvfp4", "nvfp4" | None)        nvfp4-w4a4 / nvfp4-w4a16
    FP8Linear    -> ModuleScheme("fp8", "tensor"|"channel"|"block", None|"tensor"|"token"|"block")
    MXLinear     -> ModuleScheme("mx", "e4m3"|"e2m1", None | the weight element)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..quant.schemes import stored_scheme_label, stored_scheme_name


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
        """The name with what it does not say, e.g. "fp8-w8a8 channel/token", "fp8-block block/token"
        (``quant.schemes.stored_scheme_label``)."""
        return stored_scheme_label(self.kind, self.weights, self.inputs)


@dataclass(frozen=True)
class ModuleRules:
    """What the config does not say: NVFP4 W4A4 activation ``input_scale_rule`` / ``input_error``,
    the MX ``scale_rule`` (activations of mxfp8 / mxfp4; the stored weights do not depend on it)."""

    input_scale_rule: Optional[str] = None
    input_error: str = "mse"
    scale_rule: str = "ceil"


__all__ = ["ModuleRules", "ModuleScheme"]
