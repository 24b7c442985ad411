"""FP8Linear: the inference layer of an FP8 (E4M3) post-training-quantized Linear.

Weights are E4M3 codes with FP32 dequantization scales ``s = amax / 448`` per tensor, per output
channel or per 128x128 tile (quant.fp8 numerics: ``q = E4M3_RNE(clamp(w / s, -448, 448))``,
``w^ = q * s``); ``y = x_q @ w^T + b`` where x_q is

    None     x                                           (weights only, "fp8-w8a16")
    "tensor" E4M3_RNE(clamp(x / s_in, -448, 448)) * s_in  (static: s_in = calibrated amax / 448)
    "token"  x fake-quantized with one dynamic scale per row  (FP8("e4m3", "token"))
    "block"  x fake-quantized with one dynamic scale per 1x128 group  (FP8("e4m3", "block", (1, 128)))

The dequantized weight is cached (not part of the state dict) and rebuilt when the buffers change.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UsageError
from ..quant import FP8, QuantizedTensor, fake_quantize
from ..quant.fp8 import dequantize_values, encode_with_scale, scale_from_amax
from .quantized_linear import QuantizedInferenceLinear, keep_buffer_dtypes

WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
INPUT_GRANULARITIES = (None, "tensor", "token", "block")
TILE = 128


def _choices(values) -> str:
    return ", ".join(map(repr, values))


def weight_scale_shape(granularity: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The module's ``weight_scale`` shape: tensor [1], channel [N, 1], block [ceil(N/128), ceil(K/128)]."""
    if granularity == "tensor":
        return (1,)
    if granularity == "channel":
        return (out_features, 1)
    return (-(-out_features // TILE), -(-in_features // TILE))


def weight_spec(granularity: str) -> FP8:
    """The quant.fp8 spec of an FP8Linear weight of ``granularity``."""
    return FP8("e4m3", "block", (TILE, TILE)) if granularity == "block" else FP8("e4m3", granularity)


class FP8Linear(QuantizedInferenceLinear):
    """Linear layer with FP8 (E4M3) weights and optionally FP8 activations.

    Buffers (the checkpoint's tensors, compressed-tensors' names): ``weight`` float8_e4m3fn [N, K],
    ``weight_scale`` FP32 (tensor [1], channel [N, 1], block [ceil(N/128), ceil(K/128)]) and, for
    static per-tensor activations, ``input_scale`` FP32 [1]. ``bias`` (if any) is a parameter in the
    model dtype (requires_grad False).
    """

    initial_values = {"weight_scale": 1.0}
    kind = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 weight_granularity: str = "tensor", input_granularity: Optional[str] = None,
                 dtype: torch.dtype = torch.float32, device=None):
        if weight_granularity not in WEIGHT_GRANULARITIES:
            raise UsageError(f"weight_granularity={weight_granularity!r} is not supported; allowed values: "
                             f"{_choices(WEIGHT_GRANULARITIES)}")
        if input_granularity not in INPUT_GRANULARITIES:
            raise UsageError(f"input_granularity={input_granularity!r} is not supported; allowed values: "
                             f"{_choices(INPUT_GRANULARITIES)}")
        if in_features < 1 or out_features < 1:
            raise UsageError(f"in_features={in_features}, out_features={out_features}: both must be positive")
        super().__init__(weight_spec(weight_granularity), in_features, out_features, bias, dtype=dtype, device=device)
        self.weight_granularity, self.input_granularity = weight_granularity, input_granularity
        if input_granularity == "tensor":
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_scale = None

    @property
    def weight_spec(self) -> FP8:
        return weight_spec(self.weight_granularity)

    @property
    def stored(self) -> tuple:
        return ("fp8", self.weight_granularity, self.input_granularity)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                       input_granularity: Optional[str] = None, input_scale: Optional[torch.Tensor] = None,
                       dtype: Optional[torch.dtype] = None) -> "FP8Linear":
        """Wrap an E4M3 ``QuantizedTensor`` of a [N, K] weight (granularity tensor, channel or 128x128
        block); ``input_scale`` (FP32, one element) is required for, and only for, input "tensor"."""
        spec = q.spec
        if not isinstance(spec, FP8) or len(q.shape) != 2:
            raise UsageError(f"expected a 2-D FP8 QuantizedTensor, got {q!r}")
        if spec.element != "e4m3":
            raise UsageError(f"q.spec.element={spec.element!r}: FP8Linear stores E4M3 weights only")
        tiles = spec.granularity != "block" or spec.block_shape == (TILE, TILE)
        if spec.granularity not in WEIGHT_GRANULARITIES or not tiles:
            raise UsageError(f"q.spec={spec}: FP8Linear weights are quantized per 'tensor', 'channel' or "
                             "'block' with block_shape (128, 128)")
        if (input_scale is None) != (input_granularity != "tensor"):
            raise UsageError(f"input_granularity={input_granularity!r} with input_scale "
                             f"{'None' if input_scale is None else 'given'}: static per-tensor activations "
                             "(input_granularity='tensor') need input_scale, the others take none")
        N, K = q.shape
        dtype = dtype or (bias.dtype if bias is not None else q.dtype)
        m = cls(K, N, bias is not None, weight_granularity=spec.granularity, input_granularity=input_granularity,
                dtype=dtype, device=q.codes.device)
        if tuple(q.codes.shape) != (N, K) or q.codes.dtype != torch.float8_e4m3fn:
            raise UsageError(f"q.codes is {tuple(q.codes.shape)}:{q.codes.dtype}; expected ({N}, {K}):float8_e4m3fn")
        if q.scales.numel() != m.weight_scale.numel():
            raise UsageError(f"q.scales has shape {tuple(q.scales.shape)}; expected {tuple(m.weight_scale.shape)} "
                             f"for {spec.granularity} scales of a ({N}, {K}) weight")
        m.load_quantized(q, bias)
        if input_scale is not None:
            if input_scale.numel() != 1:
                raise UsageError(f"input_scale has {input_scale.numel()} elements; a static per-tensor input "
                                 "scale has 1")
            m.input_scale.copy_(input_scale.reshape(1))
        return m

    @classmethod
    def empty(cls, stored, in_features, out_features, bias=False, *, rules=None, dtype=torch.float32,
              device=None) -> "FP8Linear":
        return cls(in_features, out_features, bias, weight_granularity=stored[1], input_granularity=stored[2],
                   dtype=dtype, device=device)

    @classmethod
    def from_scheme(cls, q, bias, scheme, input_amax, dtype) -> "FP8Linear":
        """Inputs as ``scheme.stored`` says; static ("tensor"): s_in = input_amax / 448 (zero amax -> 1)."""
        g = scheme.stored[2]
        s_in = scale_from_amax(torch.tensor([float(input_amax)], dtype=torch.float32), "e4m3") if g == "tensor" \
            else None
        return cls.from_quantized(q, bias, input_granularity=g, input_scale=s_in, dtype=dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x fake-quantized to E4M3 as ``input_granularity`` says (see the module docstring); x's dtype."""
        g = self.input_granularity
        if g is None:
            return x
        if g == "tensor":
            s = self.input_scale.to(torch.float32)
            return dequantize_values(encode_with_scale(x.detach(), s, "e4m3"), s).to(x.dtype)
        spec = FP8("e4m3", "token") if g == "token" else FP8("e4m3", "block", (1, TILE))
        return fake_quantize(x, spec, check_finite=False)

    def extra_repr(self) -> str:
        act = "weights only" if self.input_granularity is None else f"activations {self.input_granularity}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"FP8 E4M3 weights {self.weight_granularity}, {act}")


__all__ = ["FP8Linear", "INPUT_GRANULARITIES", "WEIGHT_GRANULARITIES", "keep_buffer_dtypes", "weight_scale_shape",
           "weight_spec"]
