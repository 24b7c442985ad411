"""Where an FP8 tensor's codes and scales live: the group geometry and the stored layout.

A tensor of shape ``shape`` is viewed as ``L`` matrices [N, K] (K = the last dim); one scale covers
a ``gm x gk`` group of a matrix. Partial groups at the end of N or K hold the remainder: their scale
comes from the elements present (the same as zero padding, which never changes an amax).

    granularity       view [L, N, K]                    group     scales (float32)
    tensor            [1, R, K]  R = prod(shape[:-1])   all       []
    channel / token   [1, R, K]                         1 x K     shape[:-1] + (1,)
    block (1, 128)    [1, R, K]                         1 x 128   shape[:-1] + (ceil(K/128),)
    block (128, 128)  [prod(shape[:-2]), N, K]          128 x 128 shape[:-2] + (ceil(N/128), ceil(K/128))

codes: a torch float8 tensor (float8_e4m3fn / float8_e5m2) of ``shape`` itself (nothing is padded).
A 0-d tensor is one row of one element (scales (1,) per row / 1x128, (1, 1) per 128x128 tile); a
1-d tensor under 128x128 tiles is one row (scales (1, ceil(K/128))). Tensors of more than two dims
keep their leading dims: per-row and 1x128 scales per row of the last dim, 128x128 tiles per
trailing matrix (e.g. one grid of tiles per expert of [E, N, K]).
"""
from __future__ import annotations

import math

import torch

from ...formats.fp8 import FP8_DTYPES
from .spec import FP8


def geometry(spec: FP8, shape) -> tuple[int, int, int, int, int]:
    """(L, N, K, gm, gk): ``shape`` as L matrices [N, K] with one scale per gm x gk group."""
    shape = tuple(shape)
    K = shape[-1] if shape else 1
    group = spec.group_shape
    if group == (128, 128):
        N = shape[-2] if len(shape) >= 2 else 1
        return math.prod(shape[:-2]), N, K, 128, 128
    R = math.prod(shape[:-1])
    if group is None or group == (1, 0):
        return 1, R, K, 1, K
    return 1, R, K, group[0], group[1]


def scales_shape(spec: FP8, shape) -> tuple:
    """The shape of the FP32 scales of a tensor of ``shape`` (see the module docstring)."""
    shape = tuple(shape)
    group = spec.group_shape
    if group is None:
        return ()
    lead = shape[:-1]
    K = shape[-1] if shape else 1
    if group == (1, 0):
        return lead + (1,)
    if group == (1, 128):
        return lead + (-(-K // 128),)
    N = shape[-2] if len(shape) >= 2 else 1
    return shape[:-2] + (-(-N // 128), -(-K // 128))


def layout(spec: FP8, shape) -> dict:
    """{"codes": (shape, dtype), "scales": (shape, dtype)} that ``quantize_fp8`` stores."""
    if not isinstance(spec, FP8):
        raise TypeError(f"spec must be blockscale.FP8, got {type(spec).__name__}")
    shape = tuple(shape)
    return {"codes": (shape, FP8_DTYPES[spec.element]), "scales": (scales_shape(spec, shape), torch.float32)}


def check_layout(q) -> None:
    """ValueError (TypeError for a non-tensor field) unless q's codes and scales fit ``q.shape`` and
    ``q.spec`` as ``layout`` says, and q carries no other format's fields (``check_no_extra``)."""
    shape = tuple(q.shape)
    where = f"for an FP8 tensor of shape {shape}"
    for name, (want_shape, want_dtype) in layout(q.spec, shape).items():
        t = getattr(q, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"q.{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want_shape:
            raise ValueError(f"q.{name} has shape {tuple(t.shape)}; expected {want_shape} {where}")
        if t.dtype != want_dtype:
            raise ValueError(f"q.{name} has dtype {t.dtype}; expected {want_dtype} {where}")
    check_no_extra(q)


def check_no_extra(q) -> None:
    """ValueError if q carries an outer scale, amax or rotation signs (the registry's ``check_extra``)."""
    for name in ("outer_scale", "amax", "signs"):
        if getattr(q, name, None) is not None:
            raise ValueError(f"q.{name} is set, but an FP8 tensor has none (its FP32 scales are q.scales)")


__all__ = ["check_layout", "check_no_extra", "geometry", "layout", "scales_shape"]
