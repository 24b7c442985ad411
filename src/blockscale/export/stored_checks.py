"""The loader's checks of one quantized Linear's stored values, per tensor kind (a codec's
``check_stored``; see ``validate`` for each check): ``check_stored(s, name, N, K, view, path)`` with
``view(suffix)`` the stored tensor ``<name>.<suffix>`` and ``path(suffix)`` its file."""
from __future__ import annotations

from typing import Callable

from ..nn.quantized_linear import weight_buffers
from ..quant import MX
from .validate import (check_block_scales, check_decode_range, check_fp8_codes, check_fp8_range, check_mx_finite,
                       check_outer_scale, check_positive, check_ue8m0)


def nvfp4_stored(names: dict, decode: Callable) -> Callable[..., None]:
    """NVFP4 stored under ``names`` (NVFP4Linear buffer -> suffix): finite non-negative block scales,
    positive normal finite outer scales, block scales times ``decode(stored outer scale)`` finite."""
    def check(s, name: str, N: int, K: int, view, path) -> None:
        scale, outer = names["weight_scale"], names["weight_global_scale"]
        check_block_scales(f"{name}.{scale}", view(scale), path(scale))
        for buf in ("weight_global_scale",) + (("input_global_scale",) if s.inputs else ()):
            check_outer_scale(f"{name}.{names[buf]}", view(names[buf]), path(names[buf]))
        stored = view(outer)
        check_decode_range(f"{name}.{outer}", stored, decode(stored), view(scale), path(outer))
    return check


def fp8_stored(s, name: str, N: int, K: int, view, path) -> None:
    """E4M3 codes without NaN bytes, scales finite and > 0, weight scales within FP8's range."""
    check_fp8_codes(f"{name}.weight", view("weight"), path("weight"))
    check_positive(f"{name}.weight_scale", view("weight_scale"), path("weight_scale"))
    check_fp8_range(f"{name}.weight_scale", view("weight_scale"), path("weight_scale"))
    if s.inputs == "tensor":
        check_positive(f"{name}.input_scale", view("input_scale"), path("input_scale"))


def mx_stored(s, name: str, N: int, K: int, view, path) -> None:
    """MX: E4M3 codes without NaN bytes, UE8M0 scale bytes != 255, decoded values finite."""
    codes, (_, _, dtype) = next(iter(weight_buffers(MX(s.weights), N, K).items()))
    if dtype.is_floating_point:  # FP8 element codes (a packed element is uint8)
        check_fp8_codes(f"{name}.{codes}", view(codes), path(codes))
    t = view("weight_scale")
    check_ue8m0(f"{name}.weight_scale", t, path("weight_scale"))
    check_mx_finite(f"{name}.{codes}", s.weights, view(codes), t, (N, K), path("weight_scale"))


__all__ = ["fp8_stored", "mx_stored", "nvfp4_stored"]
