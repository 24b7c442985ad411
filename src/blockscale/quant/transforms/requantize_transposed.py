"""Training-backward requantization: a saved NVFP4 operand [M, K] -> MX of its dequantized transpose.

    nvfp4_to_mx_transposed(q, spec) == quantize(dequantize(q).t().contiguous(), spec)

The backward of an NVFP4-forward / MXFP8-backward recipe needs the saved operands quantized along
their other dim (blocks of 32 along M). On CUDA (backend "auto" or "triton") one Triton kernel
(``triton_kernels/requantize_transposed_triton.py``) does dequantize + transpose + quantize without writing the
dequantized tensor; elsewhere the torch reference below runs. Same bits for round-to-nearest;
stochastic rounding in the kernel draws from Philox seeded by ``generator`` (as the NVFP4 Triton
kernel does), and ``rand_bits`` makes the reference consume exactly the kernel's draws.
"""
from __future__ import annotations

import math

import torch

from ...formats.constants import MX_BLOCK
from ..backend import want_triton
from ..blocking import pad_dim, random_from_bits, triton_seed
from ..mx import MX, quantize_mx, quantize_mx_blocks
from ..nvfp4 import NVFP4, dequantize_nvfp4
from ..tensor import QuantizedTensor

FUSED_ELEMENTS = ("e4m3", "e5m2")


def _check(q: QuantizedTensor, spec: MX) -> None:
    if not isinstance(q.spec, NVFP4) or len(q.shape) != 2:
        raise ValueError(f"nvfp4_to_mx_transposed needs a 2-D NVFP4 QuantizedTensor, got {q!r}")
    if not isinstance(spec, MX) or spec.dim not in (-1, 1):
        raise ValueError(f"nvfp4_to_mx_transposed quantizes the [K, M] transpose along its last dim: "
                         f"expected an MX spec with dim=-1, got {spec!r}")


def fused_supported(q: QuantizedTensor, spec) -> bool:
    """Whether the fused Triton kernel covers (q, spec) and should run for q's device."""
    return (isinstance(q.spec, NVFP4) and len(q.shape) == 2 and isinstance(spec, MX) and spec.dim in (-1, 1)
            and spec.element in FUSED_ELEMENTS and q.codes.numel() > 0 and want_triton(q.codes))


def nvfp4_to_mx_transposed_reference(q: QuantizedTensor, spec: MX, generator: torch.Generator | None = None,
                                     rand_bits: torch.Tensor | None = None, outputs: str = "codes"):
    """The torch reference: quantize(dequantize(q).t().contiguous(), spec) (FP32 in between).

    rand_bits: stochastic rounding only: one raw uint32 draw per element of the padded [K, Mp]
    layout (Mp = M rounded up to 32), e.g. ``nvfp4_triton.random_bits(K * Mp, seed, offset)``.
    outputs: "codes" -> QuantizedTensor; "values" -> FP32 [K, M]; "both" -> (QuantizedTensor, values).
    """
    _check(q, spec)
    xt = dequantize_nvfp4(q, torch.float32).t().contiguous()
    if rand_bits is None or spec.rounding != "stochastic":
        return quantize_mx(xt, spec, generator, outputs)
    K, M = xt.shape
    xp = pad_dim(xt, -1, MX_BLOCK)
    Mp = xp.shape[1]
    nb = Mp // MX_BLOCK
    rand = random_from_bits(rand_bits.to(xt.device), (K, nb, MX_BLOCK), spec.sr_mode)
    codes, scales, values = quantize_mx_blocks(xp.reshape(K, nb, MX_BLOCK), rand, spec.element, spec.scale_rule,
                                               spec.rounding, spec.sr_mode, outputs)
    if values is not None:
        values = values[:, :M]
        if outputs == "values":
            return values
    qt = QuantizedTensor(spec=spec, codes=codes, scales=scales, shape=torch.Size((K, M)), dtype=torch.float32)
    return (qt, values) if outputs == "both" else qt


def nvfp4_to_mx_transposed(q: QuantizedTensor, spec: MX, generator: torch.Generator | None = None,
                           rand_bits: torch.Tensor | None = None, outputs: str = "codes"):
    """MX (``spec``, along the last dim) quantization of ``dequantize(q).t()`` for a 2-D NVFP4 ``q``
    [M, K]: a QuantizedTensor of shape [K, M] (codes [K, Mp], UE8M0 scales [K, Mp/32]).

    Runs the fused Triton kernel where ``fused_supported`` (CUDA tensors; CPU ones under backend
    "triton" with TRITON_INTERPRET=1) unless ``rand_bits`` is given, else the torch reference.
    outputs: "codes", "values" (FP32 [K, M]) or "both", as in ``quantize_nvfp4``.
    """
    _check(q, spec)
    if rand_bits is not None or not fused_supported(q, spec):
        return nvfp4_to_mx_transposed_reference(q, spec, generator, rand_bits, outputs)
    from ..triton_kernels.requantize_transposed_triton import nvfp4_to_mx_t

    M, K = q.shape
    R = q.codes.shape[0]
    inv_s = (1.0 / q.outer_scale).expand(M, 1).reshape(M) if q.outer_scale.dim() else 1.0 / q.outer_scale
    seed = triton_seed(generator, q.device) if spec.rounding == "stochastic" else 0
    want_codes, want_values = outputs != "values", outputs != "codes"
    codes, scales, values = nvfp4_to_mx_t(q.codes.reshape(R, -1), q.scales.reshape(R, -1), inv_s, K, spec.element,
                                          spec.scale_rule, spec.rounding, spec.sr_mode, seed, 0, want_codes,
                                          want_values)
    if want_values:
        values = values[:, :M]
        if not want_codes:
            return values
    qt = QuantizedTensor(spec=spec, codes=codes, scales=scales, shape=torch.Size((K, M)), dtype=torch.float32)
    return (qt, values) if want_values else qt


def padded_numel(q: QuantizedTensor) -> int:
    """Number of random draws (one per element of the padded [K, Mp] output) a stochastic call consumes."""
    M, K = q.shape
    return K * math.ceil(M / MX_BLOCK) * MX_BLOCK


__all__ = ["nvfp4_to_mx_transposed", "nvfp4_to_mx_transposed_reference", "fused_supported", "padded_numel"]
