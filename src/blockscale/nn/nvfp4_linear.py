"""NVFP4Linear: the inference layer of a post-training-quantized model (what a checkpoint stores).

Weights are NVFP4 (packed E2M1 codes, E4M3 block scales per 16 inputs, one FP32 encode scale S);
``y = x_q @ dequantize(W)^T + b`` where ``x_q = x`` (W4A16) or, for W4A4, x fake-quantized to NVFP4
with dynamic per-16 block scales and the calibrated encode scale ``input_global_scale``.
The dequantized weight is cached (not part of the state dict) and rebuilt when the buffers change.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..quant import NVFP4, QuantizedTensor, fake_quantize
from ..quant.nvfp4 import INPUT_SCALE_RULES, input_encode_scale
from .quantized_linear import QuantizedInferenceLinear


class NVFP4Linear(QuantizedInferenceLinear):
    """Linear layer with NVFP4 weights (and optionally NVFP4 activations).

    Buffers (the checkpoint's tensors): ``weight_packed`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn [N, K/16], ``weight_global_scale`` FP32 [1] (S: x^ = q * s * (1/S)), and for W4A4
    ``input_global_scale`` FP32 [1]. ``bias`` (if any) is a parameter in the model dtype.
    (Storage, cache and forward: ``QuantizedInferenceLinear``.)
    in_features must be a multiple of 16 (what serving kernels accept).
    """

    initial_values = {"weight_global_scale": 1.0}
    kind = "nvfp4"
    stacked_flat = frozenset({"weight_global_scale", "input_global_scale"})

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        if in_features % 16:
            raise ValueError(f"in_features={in_features}: NVFP4 checkpoints need a multiple of 16 inputs "
                             "(one E4M3 scale per 16); keep this layer in high precision instead")
        if input_scale_rule is not None and input_scale_rule not in INPUT_SCALE_RULES:
            raise ValueError(f"input_scale_rule={input_scale_rule!r}; allowed values: None (W4A16), "
                             f"{', '.join(map(repr, INPUT_SCALE_RULES))}")
        super().__init__(NVFP4(), in_features, out_features, bias, dtype=dtype, device=device)
        self.input_scale_rule = input_scale_rule
        self.input_error = input_error
        if input_scale_rule is not None:
            self.register_buffer("input_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_global_scale = None

    @property
    def weight_spec(self) -> NVFP4:
        return NVFP4()

    @property
    def rules(self) -> dict:
        return {"input_scale_rule": self.input_scale_rule, "input_error": self.input_error}

    @property
    def stored(self) -> tuple:
        return ("nvfp4", "nvfp4", None if self.input_global_scale is None else "nvfp4")

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
        m.load_quantized(q, bias)
        if input_global_scale is not None:
            m.input_global_scale.copy_(input_global_scale.reshape(1))
        return m

    @classmethod
    def empty(cls, stored, in_features, out_features, bias=False, *, rules=None, dtype=torch.float32,
              device=None) -> "NVFP4Linear":
        """W4A4 when ``stored`` has inputs: ``rules["input_scale_rule"]`` (default "6") / ``["input_error"]``."""
        rules = rules or {}
        w4a4 = stored[2] is not None
        return cls(in_features, out_features, bias, input_scale_rule=(rules.get("input_scale_rule") or "6") if w4a4
                   else None, input_error=rules.get("input_error", "mse") if w4a4 else "mse", dtype=dtype,
                   device=device)

    @classmethod
    def from_scheme(cls, q, bias, scheme, input_amax, dtype) -> "NVFP4Linear":
        """W4A4 (static inputs): the input encode scale ``input_encode_scale(input_amax, act_scale_rule)``."""
        kw = {}
        if scheme.static_activations:
            kw = dict(input_global_scale=input_encode_scale(input_amax, scheme.act_scale_rule),
                      input_scale_rule=scheme.act_scale_rule, input_error=scheme.error)
        return cls.from_quantized(q, bias, dtype=dtype, **kw)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """W4A4: x fake-quantized to NVFP4 (per-16 dynamic block scales, the calibrated S); else x."""
        if self.input_global_scale is None:
            return x
        spec = NVFP4(scale_rule=self.input_scale_rule, error=self.input_error)
        return fake_quantize(x, spec, encode_scale=self.input_global_scale, check_finite=False)

    def extra_repr(self) -> str:
        act = "W4A16" if self.input_scale_rule is None else f"W4A4 (activations scale_rule={self.input_scale_rule})"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {act}"


__all__ = ["NVFP4Linear"]
