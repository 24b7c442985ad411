"""NVFP4 scales: the FP32 outer scale S and the E4M3 block scales s, one implementation of each formula.

    S    = min(bound*6 / amax, FLT_MAX), 1 where amax = 0     outer_scale   (bound 448; 256 for "4over6", "4")
    amax = bound*6 / S                                        amax_of_outer_scale (the amax a given S stands for)
    t    = block_amax * (S * (1/6))
    s6   = e4m3_rne(min(t, 448))                              scale-to-6    block_scales(..., target=6)
    s4   = e4m3_rne(min(1.5*t, 448))                          scale-to-4    block_scales(..., target=4)

Every division is a true FP32 division (``float / tensor`` would be reciprocal-then-multiply: two
roundings). See ``../shared/spec/numerics.md``.
"""
from __future__ import annotations

import math

import torch

from ...formats.minifloat import E4M3, round_magnitude
from ..blocking import abs_max

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN_NORMAL = 2.0**-126
BLOCK = 16  # elements per E4M3 block scale (formats.constants.NVFP4_BLOCK)


def e4m3_positive_values() -> torch.Tensor:
    """The 126 positive finite E4M3 values, increasing (codes 0x01..0x7E): the sweep's candidates."""
    return torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


# -- outer scale --------------------------------------------------------------------------------

def outer_scale(amax: torch.Tensor, bound: float = 448.0) -> torch.Tensor:
    """S = min(bound*6 / amax, FLT_MAX), and 1 where amax is 0 (FP32, amax's shape)."""
    s = torch.clamp(torch.tensor(bound * 6.0, dtype=torch.float32, device=amax.device) / amax, max=FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(s), s)


def amax_of_outer_scale(S: torch.Tensor, bound: float = 448.0) -> torch.Tensor:
    """amax = bound*6 / S (FP32, S's shape): the amax stored beside a given outer scale S."""
    return torch.tensor(bound * 6.0, dtype=torch.float32, device=S.device) / S


def shared_outer_scale(tensors, bound: float = 448.0) -> torch.Tensor:
    """One outer scale for a group of tensors (e.g. a fused q/k/v): S = outer_scale(max_i max|t_i|), 0-d FP32.

    Empty tensors count as amax 0; NaN propagates.
    """
    amaxes = [abs_max(t.detach()) for t in tensors]
    if not amaxes:
        raise ValueError("shared_outer_scale: tensors is empty; pass the tensors that share the scale")
    return outer_scale(torch.stack(amaxes).amax(), bound)


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """Outer amax per slice of dim 0 (outer="group", e.g. per expert): [G] FP32 for x of >= 2 dims
    (G = x.shape[0]); a 0-d / 1-d x is one group ([1])."""
    G = x.shape[0] if x.dim() >= 2 else 1
    return abs_max(x.reshape(G, x.numel() // G if G else 0), dim=-1)  # not -1: ambiguous for empty tensors


def encode_scale_tensor(encode_scale, device=None) -> torch.Tensor:
    """A given outer encode scale S as a 0-d FP32 tensor (on ``device``, default its own / CPU).

    Accepts a one-element tensor (any float dtype, cast to FP32) or a Python float / int (rounded to
    FP32 as ``torch.tensor(v, dtype=torch.float32)`` does). S must be positive, normal and finite:
    x^ = q * s * (1/S) needs 1/S finite, which a subnormal S (or 0) would not give.
    """
    if isinstance(encode_scale, torch.Tensor):
        if encode_scale.device.type == "meta":
            raise ValueError("encode_scale is a meta tensor: meta tensors have no values (load or compute it first)")
        if encode_scale.numel() != 1:
            raise ValueError(f"encode_scale has shape {tuple(encode_scale.shape)}; expected one FP32 scalar "
                             "(one outer scale per tensor: a one-element tensor or a Python float)")
        S = encode_scale.detach().to(device=device or encode_scale.device, dtype=torch.float32).reshape(())
    elif isinstance(encode_scale, (int, float)) and not isinstance(encode_scale, bool):
        try:
            value = float(encode_scale)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        S = torch.tensor(value, dtype=torch.float32, device=device)
    else:
        raise TypeError(f"encode_scale={encode_scale!r}: expected a Python float or a one-element tensor "
                        "(the FP32 outer encode scale S)")
    if not (bool(torch.isfinite(S)) and float(S) >= FLT_MIN_NORMAL):
        raise ValueError(f"encode_scale={float(S)!r}: must be a positive, normal, finite FP32 scalar "
                         f"(>= 2**-126, so that 1/S is finite)")
    return S


# -- block scales -------------------------------------------------------------------------------

def e4m3_scale(t: torch.Tensor) -> torch.Tensor:
    """e4m3_rne(min(t, 448)) of FP32 t >= 0: a block scale on the E4M3 grid (as FP32)."""
    return round_magnitude(torch.clamp(t, max=448.0), E4M3)


def block_amax(xb: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """Block amax [R, nb, 1] of FP32 blocks [R, nb, 16]; 2D: the 16x16 tile amax on each of its rows."""
    a = torch.abs(xb).amax(dim=-1, keepdim=True)
    if block_2d:
        r, nb, _ = a.shape
        a = a.view(r // BLOCK, BLOCK, nb, 1).amax(dim=1, keepdim=True).expand(r // BLOCK, BLOCK, nb, 1)
        a = a.reshape(r, nb, 1)
    return a


def block_scales(amax: torch.Tensor, S: torch.Tensor, target: int = 6) -> torch.Tensor:
    """E4M3 block scales (FP32 values) from block amax >= 0 and outer scale S (broadcasting):
    target 6: e4m3_rne(min(amax*(S*(1/6)), 448)); target 4: e4m3_rne(min(1.5*amax*(S*(1/6)), 448)).

    Rule "6" uses target 6, rule "4" target 4, rule "4over6" both (``choose_4over6``).
    """
    t = amax * (S * (1.0 / 6.0))
    if target == 6:
        return e4m3_scale(t)
    if target == 4:
        return e4m3_scale(t * 1.5)
    raise ValueError(f"target={target!r}; allowed values: 6, 4")


__all__ = [
    "BLOCK", "FLT_MAX", "FLT_MIN_NORMAL", "amax_of_outer_scale", "block_amax", "block_scales", "e4m3_positive_values",
    "e4m3_scale", "encode_scale_tensor", "group_amax", "outer_scale", "shared_outer_scale",
]
