"""NVFP4Linear: the inference layer of a post-training-quantized model (what a checkpoint stores).

Weights are NVFP4 (packed E2M1 codes, E4M3 block scales per 16 inputs, one FP32 encode scale S);
``y = x_q @ dequantize(W)^T + b`` where ``x_q = x`` (W4A16) or, for W4A4, x fake-quantized to NVFP4
with dynamic per-16 block scales and the calibrated encode scale ``input_global_scale``.
The dequantized weight is cached (not part of the state dict) and rebuilt when the buffers change.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import NVFP4, QuantizedTensor, fake_quantize
# the calibrated input scale lives in quant.nvfp4; re-exported here for importers not yet switched
from ..quant.nvfp4 import INPUT_SCALE_RULES, input_encode_scale, reciprocal_fixed_point
from .fp8_linear import keep_buffer_dtypes


class NVFP4Linear(nn.Module):
    """Linear layer with NVFP4 weights (and optionally NVFP4 activations).

    Buffers (the checkpoint's tensors): ``weight_packed`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn [N, K/16], ``weight_global_scale`` FP32 [1] (S: x^ = q * s * (1/S)), and for W4A4
    ``input_global_scale`` FP32 [1]. ``bias`` (if any) is a parameter in the model dtype.
    in_features must be a multiple of 16 (what serving kernels accept).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"in_features={in_features}: NVFP4 checkpoints need a multiple of 16 inputs "
                             "(one E4M3 scale per 16); keep this layer in high precision instead")
        if input_scale_rule is not None and input_scale_rule not in INPUT_SCALE_RULES:
            raise ValueError(f"input_scale_rule={input_scale_rule!r}; allowed values: None (W4A16), "
                             f"{', '.join(map(repr, INPUT_SCALE_RULES))}")
        self.in_features, self.out_features = in_features, out_features
        self.input_scale_rule = input_scale_rule
        self.input_error = input_error
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn,
                                                         device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if input_scale_rule is not None:
            self.register_buffer("input_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_global_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self._cache: Optional[tuple] = None
        self._dtype = dtype

    @property
    def scheme_name(self) -> str:
        """"nvfp4-w4a4" (activations quantized) or "nvfp4-w4a16"."""
        return "nvfp4-w4a16" if self.input_global_scale is None else "nvfp4-w4a4"

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                       input_global_scale: Optional[torch.Tensor] = None, input_scale_rule: Optional[str] = None,
                       input_error: str = "mse", dtype: Optional[torch.dtype] = None) -> "NVFP4Linear":
        """Wrap an NVFP4 ``QuantizedTensor`` of a [N, K] weight with one outer scale."""
        if not isinstance(q.spec, NVFP4) or len(q.shape) != 2:
            raise ValueError(f"expected a 2-D NVFP4 QuantizedTensor, got {q!r}")
        if q.outer_scale.numel() != 1:
            raise ValueError("checkpoint formats store one outer scale per weight; quantize with outer='tensor' "
                             "or a shared encode_scale")
        if (input_global_scale is None) != (input_scale_rule is None):
            raise ValueError("W4A4 needs both input_global_scale and input_scale_rule (or neither for W4A16)")
        N, K = q.shape
        dtype = dtype or (bias.dtype if bias is not None else q.dtype)
        m = cls(K, N, bias is not None, input_scale_rule=input_scale_rule, input_error=input_error, dtype=dtype,
                device=q.codes.device)
        m.weight_packed.copy_(q.codes)
        m.weight_scale.copy_(q.scales)
        m.weight_global_scale.copy_(q.outer_scale.reshape(1))
        if input_global_scale is not None:
            m.input_global_scale.copy_(input_global_scale.reshape(1))
        if bias is not None:
            m.bias.data.copy_(bias.detach())
        return m

    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a ``QuantizedTensor`` (shares the buffers)."""
        S = self.weight_global_scale.reshape(())
        return QuantizedTensor(spec=NVFP4(), codes=self.weight_packed, scales=self.weight_scale,
                               shape=torch.Size((self.out_features, self.in_features)), dtype=self._dtype,
                               outer_scale=S)

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """x^ = (q * s) * (1/S) in FP32, cast to ``dtype`` (default: the layer's dtype); cached."""
        dtype = dtype or self._dtype
        key = (dtype, self.weight_packed.device, self.weight_packed._version, self.weight_scale._version,
               self.weight_global_scale._version, self.weight_packed.data_ptr())
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.quantized_weight().dequantize(dtype))
        return self._cache[1]

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """W4A4: x fake-quantized to NVFP4 (per-16 dynamic block scales, the calibrated S); else x."""
        if self.input_global_scale is None:
            return x
        spec = NVFP4(scale_rule=self.input_scale_rule, error=self.input_error)
        return fake_quantize(x, spec, encode_scale=self.input_global_scale, check_finite=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized_weight(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(self.quantize_input(x), w, b)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the bias only, never the codes and scales (as FP8Linear / MXLinear)."""
        self._cache = None
        return keep_buffer_dtypes(self, super()._apply, fn, recurse)

    def extra_repr(self) -> str:
        act = "W4A16" if self.input_scale_rule is None else f"W4A4 (activations scale_rule={self.input_scale_rule})"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {act}"


__all__ = ["NVFP4Linear"]
