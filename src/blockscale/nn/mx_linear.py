"""MXLinear: the inference layer of an MXFP8 / MXFP4 post-training-quantized Linear.

Weights are MX (OCP microscaling) along the input dim: one UE8M0 scale (biased exponent b,
``2**(b - 127)``) per 32 inputs, E4M3 (MXFP8) or E2M1 (MXFP4) elements: ``w^ = v * 2**(b - 127)``
(quant.mx numerics). ``y = x_q @ w^T + b`` where ``x_q = x`` (weights only) or x fake-quantized to
MX with dynamic per-32 scales (``fake_quantize(x, MX(input_element, scale_rule))``).
The dequantized weight is cached (not part of the state dict) and rebuilt when the buffers change.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UsageError
from ..quant import MX, QuantizedTensor, fake_quantize
from ..quant.mx import BLOCK, MX_SCALE_RULES
from .quantized_linear import QuantizedInferenceLinear

MX_LINEAR_ELEMENTS = ("e4m3", "e2m1")


def _choices(values) -> str:
    return ", ".join(map(repr, values))


class MXLinear(QuantizedInferenceLinear):
    """Linear layer with MX weights (MXFP8 E4M3 or MXFP4 E2M1) and optionally MX activations.

    Buffers (the checkpoint's tensors, compressed-tensors' names): MXFP8 ``weight`` float8_e4m3fn
    [N, K]; MXFP4 ``weight_packed`` uint8 [N, K/2] (element 2i in the low nibble); both
    ``weight_scale`` uint8 [N, K/32] (UE8M0 biased exponents). ``bias`` (if any) is a parameter in
    the model dtype (requires_grad False). in_features must be a multiple of 32 (one scale per 32).
    input_element: None (weights only) or the weight's element (MXFP8 x MXFP8, MXFP4 x MXFP4).
    (Storage, cache and forward: ``QuantizedInferenceLinear``.)
    """

    initial_values = {"weight_scale": 127}  # 2**0: every block scale 1
    kind = "mx"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, element: str = "e4m3",
                 input_element: Optional[str] = None, scale_rule: str = "ceil",
                 dtype: torch.dtype = torch.float32, device=None):
        if element not in MX_LINEAR_ELEMENTS:
            raise UsageError(f"element={element!r} is not supported; allowed values: {_choices(MX_LINEAR_ELEMENTS)}")
        if input_element not in (None, element):
            raise UsageError(f"input_element={input_element!r} with element={element!r}; allowed values: None "
                             f"(weights only) or {element!r} (the schemes mxfp8 / mxfp4 quantize activations "
                             "to the weights' element)")
        if scale_rule not in MX_SCALE_RULES:
            raise UsageError(f"scale_rule={scale_rule!r} is not supported; allowed values: {_choices(MX_SCALE_RULES)}")
        if in_features < 1 or in_features % BLOCK or out_features < 1:
            raise UsageError(f"in_features={in_features}: MX checkpoints need a positive multiple of {BLOCK} inputs "
                             f"(one UE8M0 scale per {BLOCK}); keep this layer in high precision instead")
        super().__init__(MX(element, scale_rule), in_features, out_features, bias, dtype=dtype, device=device)
        self.element, self.input_element, self.scale_rule = element, input_element, scale_rule

    @property
    def weight_spec(self) -> MX:
        return MX(self.element, self.scale_rule)

    @property
    def rules(self) -> dict:
        return {"scale_rule": self.scale_rule}

    @property
    def stored(self) -> tuple:
        return ("mx", self.element, self.input_element)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, q: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                       input_element: Optional[str] = None, scale_rule: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None) -> "MXLinear":
        """Wrap an MX ``QuantizedTensor`` of a [N, K] weight blocked along K (``spec.dim`` -1 / 1);
        scale_rule None: the spec's (it only matters for the activations)."""
        spec = q.spec
        if not isinstance(spec, MX) or len(q.shape) != 2:
            raise UsageError(f"expected a 2-D MX QuantizedTensor, got {q!r}")
        if spec.dim not in (-1, 1):
            raise UsageError(f"q.spec.dim={spec.dim}: MXLinear weights are blocked along the input dim (dim=-1)")
        N, K = q.shape
        m = cls(K, N, bias is not None, element=spec.element, input_element=input_element,
                scale_rule=scale_rule or spec.scale_rule,
                dtype=dtype or (bias.dtype if bias is not None else q.dtype), device=q.codes.device)
        for name, src, dst in (("codes", q.codes, m.codes), ("scales", q.scales, m.weight_scale)):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise UsageError(f"q.{name} is {tuple(src.shape)}:{src.dtype}; expected "
                                 f"{tuple(dst.shape)}:{dst.dtype} for MX {spec.element} of a ({N}, {K}) weight")
        m.load_quantized(q, bias)
        return m

    @classmethod
    def empty(cls, stored, in_features, out_features, bias=False, *, rules=None, dtype=torch.float32,
              device=None) -> "MXLinear":
        """``rules["scale_rule"]``: the activations' MX scale rule (default "ceil")."""
        return cls(in_features, out_features, bias, element=stored[1], input_element=stored[2],
                   scale_rule=(rules or {}).get("scale_rule", "ceil"), dtype=dtype, device=device)

    @classmethod
    def from_scheme(cls, q, bias, scheme, input_amax, dtype) -> "MXLinear":
        """Inputs as ``scheme.stored`` says (the weight's element, dynamic per 32, or none)."""
        return cls.from_quantized(q, bias, input_element=scheme.stored[2], dtype=dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x fake-quantized to MX(input_element, scale_rule) with dynamic per-32 scales; else x."""
        if self.input_element is None:
            return x
        return fake_quantize(x, MX(self.input_element, self.scale_rule), check_finite=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.scheme_name} (scale_rule={self.scale_rule})")


__all__ = ["MXLinear", "MX_LINEAR_ELEMENTS"]
