"""The storage layout of a QuantizedTensor: which codes / scales shapes and dtypes fit its shape and spec.

For a tensor of shape ``shape`` with blocks along dim d (the format's ``blocked_dim``: the last dim;
``spec.dim`` for MX, whose codes and scales are stored with that dim moved last), ``lead`` = the
other dims, K = the block dim's size (1 for a 0-d tensor) and Kp = K padded to whole blocks. Each
format's ``layout`` says what it stores, e.g.

    NVFP4   codes lead + (Kp/2,) uint8 (two E2M1 per byte)  scales lead + (Kp/16,) float8_e4m3fn
            outer_scale broadcastable to lead + (1,)
    MX      codes lead + (Kp,) float8_e4m3fn / float8_e5m2, or lead + (Kp/2,) uint8 (E2M1)
            scales lead + (Kp/32,) uint8 (UE8M0)
    S2F6    codes lead + (Kp,) int8                          scales lead + (Kp/32,) uint8 (UE8M0)
            signs (32,) with hadamard=True, None without

``check_layout`` raises ValueError naming the first field that does not fit (dequantize calls it,
so truncated or mis-shaped codes never reshape into wrong values).
"""
from __future__ import annotations

import torch

from .registry import format_of


def block_dims(shape: tuple, dim: int = -1) -> tuple[tuple, int]:
    """(lead dims, K): the block dim ``dim`` moved last; a 0-d shape gives ((), 1)."""
    shape = tuple(shape)
    if not shape:
        return (), 1
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"spec.dim={dim} is out of range for a tensor with {len(shape)} dims")
    dim %= len(shape)
    return shape[:dim] + shape[dim + 1:], shape[dim]


def padded_blocks(shape: tuple, dim: int, block: int) -> tuple[tuple, int]:
    """(lead dims, Kp): ``block_dims`` with K padded up to whole blocks of ``block``."""
    lead, K = block_dims(shape, dim)
    return lead, -(-K // block) * block


def expected_layout(spec, shape) -> dict:
    """{"codes": (shape, dtype), "scales": (shape, dtype)} that ``quantize`` stores for ``spec`` and an
    original tensor shape ``shape`` (shapes as tuples)."""
    return format_of(spec).layout(spec, tuple(shape))


def check_tensor(t, name: str) -> None:
    """TypeError unless ``t`` is a tensor (meta tensors pass: dequantizing a meta QuantizedTensor gives
    a meta result, for shape propagation)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_field(t, name: str, want_shape: tuple, want_dtype, kind: str, shape: tuple) -> None:
    check_tensor(t, name)
    where = f"for an {kind} tensor of shape {shape}"
    if tuple(t.shape) != want_shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want_shape} {where}")
    if t.dtype != want_dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {want_dtype} {where}")


def check_layout(q) -> None:
    """ValueError (TypeError for a non-tensor field) unless ``q``'s codes, scales and its format's own
    fields (``Format.check_extra``: NVFP4's outer scale, S2F6's rotation signs) fit ``q.shape`` and
    ``q.spec`` as ``expected_layout`` says."""
    shape = tuple(q.shape)
    fmt = format_of(q.spec, "q.spec")
    kind = type(q.spec).__name__
    lay = fmt.layout(q.spec, shape)
    _check_field(q.codes, "q.codes", *lay["codes"], kind, shape)
    _check_field(q.scales, "q.scales", *lay["scales"], kind, shape)
    if fmt.check_extra is not None:
        fmt.check_extra(q)


__all__ = ["block_dims", "check_layout", "check_tensor", "expected_layout", "padded_blocks"]
