"""Quantizing one fused group of Linears with its PTQ scheme (``recipes.Scheme``): the group's shared
weight scale, round-to-nearest weights and the activation quantizer a server applies (the inference
module that replaces each nn.Linear: ``scheme_modules.build_linear``).

    family  group-shared weight scale                         per member
    nvfp4   outer encode scale S = shared_outer_scale(W_i)    E4M3 block scales per 16
    fp8     tensor weights: s = max_i amax(W_i) / 448         channel: s = amax(row) / 448
            (zero amax -> 1)                                  block: s = amax(128x128 tile) / 448
    mx      none                                              UE8M0 exponent per 32

Static activation scales (nvfp4-w4a4, fp8-w8a8 with static activations) come from the group's
calibrated input amax: NVFP4 ``input_encode_scale(amax, act_scale_rule)``; FP8 ``s_in = amax / 448``
(zero amax -> 1). FP8 codes are ``E4M3_RNE(clamp(w / s, -448, 448))`` (``quant.fp8.encode_with_scale``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..formats.fp8 import FP8_DTYPES
from ..quant import FP8, NVFP4, QuantizedTensor, quantize
from ..quant.fp8 import encode_with_scale, scale_from_amax
from ..quant.nvfp4 import shared_outer_scale
from ..quant.nvfp4.weighted import WEIGHTED_RULES, quantize_weighted


def group_weight_scale(scheme, weights) -> Optional[torch.Tensor]:
    """The weight scale a fused group shares (0-d FP32), None when each member has its own.

    nvfp4: the outer encode scale ``shared_outer_scale(weights, bound)``; fp8 with per-tensor
    weights: the dequantization scale ``max_i amax(W_i) / 448`` (1 when that is 0); otherwise None.
    ValueError for non-finite weights (from ``shared_outer_scale`` / the amax check).
    """
    spec = scheme.weight_spec
    if isinstance(spec, NVFP4):
        return shared_outer_scale(weights, spec.outer_bound)
    if isinstance(spec, FP8) and spec.granularity == "tensor":
        amax = max((float(w.detach().abs().max()) for w in weights if w.numel()), default=0.0)
        if not torch.isfinite(torch.tensor(amax)):
            raise ValueError("weights contain NaN/inf")
        return scale_from_amax(torch.tensor(amax, dtype=torch.float32, device=weights[0].device), spec.element)
    return None


def fp8_with_scale(weight: torch.Tensor, spec: FP8, s: torch.Tensor) -> QuantizedTensor:
    """``weight`` as FP8 with the given per-tensor dequantization scale ``s`` (0-d FP32):
    codes ``E4M3_RNE(clamp(w / s, -max, max))``."""
    s = s.to(device=weight.device, dtype=torch.float32).reshape(())
    codes = encode_with_scale(weight.detach(), s, spec.element).to(FP8_DTYPES[spec.element])
    return QuantizedTensor(spec=spec, codes=codes, scales=s.clone(), shape=weight.shape, dtype=weight.dtype)


def rtn_quantize(weight: torch.Tensor, spec, shared: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Round to nearest with the group's shared scale: NVFP4 ``quantize(w, spec, encode_scale=S)``
    (exactly as before mixed recipes), FP8 per tensor with the shared s, anything else ``quantize(w, spec)``.
    NVFP4 "sweep" (1x16 blocks) of a 2-D weight with a shared S: ``quantize_weighted(w, "hessian", S, ones)``,
    the same bits as ``quantize`` (tested) through ``quant.nvfp4.sweep_fast`` (the provably losing candidates
    skipped, the rest in cache-sized chunks: ~25x faster on SmolLM2); block_2d goes to ``quantize``."""
    if isinstance(spec, NVFP4):
        if (spec == WEIGHTED_RULES["hessian"] and shared is not None and weight.dim() == 2
                and weight.shape[-1] % 16 == 0 and weight.numel()):
            return quantize_weighted(weight, "hessian", shared, torch.ones(weight.shape[-1], device=weight.device))
        return quantize(weight, spec, encode_scale=shared)
    if isinstance(spec, FP8) and spec.granularity == "tensor" and shared is not None:
        return fp8_with_scale(weight, spec, shared)
    return quantize(weight, spec)


def input_quantizer(scheme, amax: float) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """x -> the activations the scheme's inference module feeds its GEMM (None: weights only), with the
    static scale from the calibrated input ``amax`` where the scheme has one (the scheme's row:
    ``quant.schemes.SchemeRow.input_quantizer``)."""
    return scheme.input_quantizer(amax)


__all__ = ["fp8_with_scale", "group_weight_scale", "input_quantizer", "rtn_quantize"]
