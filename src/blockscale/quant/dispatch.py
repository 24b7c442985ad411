"""quantize / fake_quantize / dequantize for any format spec, with input checks."""
from __future__ import annotations

from dataclasses import replace

import torch

from .checks import INPUT_DTYPES, OUTPUT_DTYPES, check_fp32_range, check_output_dtype
from .registry import format_of, formats
from .tensor import QuantizedTensor


def _check_input(x, spec, check_finite: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError("x is a meta tensor: meta tensors have no values to quantize (load or compute them first)")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; blockscale quantizes floating tensors: "
                        "torch.float32, torch.bfloat16, torch.float16 (float64 is rounded to float32)")
    format_of(spec)  # TypeError naming the registered spec types
    if check_finite and x.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x contains {bad} NaN/inf value(s); block scales would be undefined "
                         "(pass check_finite=False to skip this check at your own risk)")
    if check_finite:
        check_fp32_range(x)
    # half-precision inputs go to the kernels as they are (converted to FP32 inside, chunk by chunk)
    return x.detach().to(torch.float32 if x.dtype == torch.float64 else x.dtype).contiguous()


def _quantize(x, spec, generator, check_finite: bool, outputs: str, encode_scale=None):
    xc = _check_input(x, spec, check_finite)
    fmt = format_of(spec)
    if encode_scale is not None and not fmt.accepts_encode_scale:
        takers = ", ".join(f.spec_type.__name__ for f in formats() if f.accepts_encode_scale)
        raise ValueError(f"encode_scale is an outer encode scale ({takers}); {type(spec).__name__} has none")
    out = fmt.quantize(xc, spec, generator, outputs, encode_scale)
    if outputs == "values":
        return out
    q = out if outputs == "codes" else out[0]
    if q.dtype != x.dtype:
        q = replace(q, dtype=x.dtype)
    return q if outputs == "codes" else (q, out[1])


def quantize(x: torch.Tensor, spec, generator: torch.Generator | None = None, *, check_finite: bool = True,
             encode_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize ``x`` (fp32 / bf16 / fp16, any shape) to ``spec``'s format.

    ``generator`` drives stochastic rounding (None: torch's default generator); results are
    deterministic for a given generator state. ``encode_scale`` (NVFP4 only): a fixed FP32 outer
    encode scale S for the whole tensor (shared by a fused group, or calibrated), replacing
    ``spec.outer``: a one-element tensor or a Python float (rounded to FP32), positive, normal, finite.
    ``check_finite``: refuse NaN / inf, and float64 values beyond the FP32 range (False skips both).
    """
    return _quantize(x, spec, generator, check_finite, "codes", encode_scale)


def quantize_with_values(x: torch.Tensor, spec, generator: torch.Generator | None = None, *,
                         check_finite: bool = True, encode_scale: torch.Tensor | None = None
                         ) -> tuple[QuantizedTensor, torch.Tensor]:
    """``(quantize(x), its FP32 dequantized values)`` from one pass over ``x``."""
    return _quantize(x, spec, generator, check_finite, "both", encode_scale)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``q`` in the original shape: computed in FP32, returned as ``dtype`` (a floating
    dtype). ValueError if q's codes / scales do not fit its shape and spec (``layout.check_layout``)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a blockscale.QuantizedTensor, got {type(q).__name__}")
    return q.dequantize(dtype)


def fake_quantize(x: torch.Tensor, spec, generator: torch.Generator | None = None, *, dtype=None,
                  check_finite: bool = True, encode_scale: torch.Tensor | None = None) -> torch.Tensor:
    """quantize then dequantize (same numerics, fused into one pass where possible); returns
    ``dtype`` (default: x's dtype; one of float32, bfloat16, float16, float64). ``encode_scale``: as
    in ``quantize``."""
    if dtype is not None:
        check_output_dtype(dtype)
    values = _quantize(x, spec, generator, check_finite, "values", encode_scale)
    return values.to(x.dtype if dtype is None else dtype)


__all__ = ["INPUT_DTYPES", "OUTPUT_DTYPES", "check_fp32_range", "check_output_dtype", "dequantize", "fake_quantize",
           "quantize", "quantize_with_values"]
