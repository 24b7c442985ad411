"""Input and output checks of the numerics API (TypeError / ValueError naming the argument and the allowed values)."""
from __future__ import annotations

import torch

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OUTPUT_DTYPES = INPUT_DTYPES
DTYPE_NAMES = "torch.float32, torch.bfloat16, torch.float16, torch.float64"  # INPUT_DTYPES, for messages
FLT_MAX = torch.finfo(torch.float32).max


def check_fp32_range(x: torch.Tensor, name: str = "x") -> None:
    """ValueError if float64 ``x`` holds a finite value beyond the FP32 range (|x| > FLT_MAX): the
    kernels compute in FP32, where it would become inf (NaN / inf block scales)."""
    if x.dtype != torch.float64 or not x.numel():
        return
    lo, hi = torch.aminmax(x)
    amax = max(-float(lo), float(hi))
    if amax > FLT_MAX:
        raise ValueError(f"{name} ({x.dtype}) has max |{name}| = {amax:.6g}, outside the FP32 range "
                         f"(|{name}| <= {FLT_MAX:.6g}) that blockscale computes in: rescale it first")


def check_output_dtype(dtype) -> None:
    """TypeError unless ``dtype`` is one of the floating dtypes results can be returned as."""
    if not isinstance(dtype, torch.dtype) or dtype not in OUTPUT_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not a supported output dtype; allowed: {DTYPE_NAMES}")


__all__ = ["DTYPE_NAMES", "FLT_MAX", "INPUT_DTYPES", "OUTPUT_DTYPES", "check_fp32_range", "check_output_dtype"]
