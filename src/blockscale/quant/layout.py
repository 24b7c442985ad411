"""The storage layout of a QuantizedTensor: which codes / scales shapes and dtypes fit its shape and spec.

For a tensor of shape ``shape`` with blocks along dim d (the last dim; ``spec.dim`` for MX, whose
codes and scales are stored with that dim moved last), ``lead`` = the other dims, K = the block
dim's size (1 for a 0-d tensor) and Kp = K padded to whole blocks:

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

from .specs import MX, NVFP4, S2F6

_MX_CODES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8}


def _moved(spec, shape: tuple) -> tuple[tuple, int]:
    """(lead dims, K): the block dim moved last (MX ``spec.dim``, else the last dim); 0-d -> ((), 1)."""
    if not shape:
        return (), 1
    dim = spec.dim if isinstance(spec, MX) else -1
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"spec.dim={dim} is out of range for a tensor with {len(shape)} dims")
    dim %= len(shape)
    return shape[:dim] + shape[dim + 1:], shape[dim]


def expected_layout(spec, shape) -> dict:
    """{"codes": (shape, dtype), "scales": (shape, dtype)} that ``quantize`` stores for ``spec`` and an
    original tensor shape ``shape`` (shapes as tuples)."""
    if not isinstance(spec, (NVFP4, MX, S2F6)):
        raise TypeError(f"spec must be blockscale.NVFP4, MX or S2F6, got {type(spec).__name__}")
    lead, K = _moved(spec, tuple(shape))
    block = spec.block_size
    Kp = -(-K // block) * block
    if isinstance(spec, NVFP4):
        codes, scales = (lead + (Kp // 2,), torch.uint8), (lead + (Kp // block,), torch.float8_e4m3fn)
    elif isinstance(spec, MX):
        width = Kp // 2 if spec.element == "e2m1" else Kp
        codes, scales = (lead + (width,), _MX_CODES[spec.element]), (lead + (Kp // block,), torch.uint8)
    else:
        codes, scales = (lead + (Kp,), torch.int8), (lead + (Kp // block,), torch.uint8)
    return {"codes": codes, "scales": scales}


def _check_tensor(t, name: str) -> None:
    # meta tensors pass: dequantizing a meta QuantizedTensor gives a meta result (shape propagation)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_field(t, name: str, want_shape: tuple, want_dtype, kind: str, shape: tuple) -> None:
    _check_tensor(t, name)
    where = f"for an {kind} tensor of shape {shape}"
    if tuple(t.shape) != want_shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want_shape} {where}")
    if t.dtype != want_dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {want_dtype} {where}")


def check_layout(q) -> None:
    """ValueError (TypeError for a non-tensor field) unless ``q``'s codes, scales, outer scale (NVFP4) and
    rotation signs (S2F6) fit ``q.shape`` and ``q.spec`` as ``expected_layout`` says."""
    shape = tuple(q.shape)
    kind = type(q.spec).__name__
    lay = expected_layout(q.spec, shape)
    _check_field(q.codes, "q.codes", *lay["codes"], kind, shape)
    _check_field(q.scales, "q.scales", *lay["scales"], kind, shape)
    if isinstance(q.spec, NVFP4):
        if q.outer_scale is None:
            raise ValueError(f"q.outer_scale is missing: an NVFP4 tensor needs its FP32 outer scale (shape {shape})")
        _check_tensor(q.outer_scale, "q.outer_scale")
        want = _moved(q.spec, shape)[0] + (1,)
        try:
            fits = torch.broadcast_shapes(tuple(q.outer_scale.shape), want) == want
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"q.outer_scale has shape {tuple(q.outer_scale.shape)}; expected a shape that "
                             f"broadcasts to {want} for an NVFP4 tensor of shape {shape}")
    if isinstance(q.spec, S2F6):
        if q.spec.hadamard and q.signs is None:
            raise ValueError("q.signs is missing: S2F6(hadamard=True) needs the 32 rotation signs to undo the rotation")
        if not q.spec.hadamard and q.signs is not None:
            raise ValueError("q.signs is set but the spec has hadamard=False: expected None (no rotation to undo)")
        if q.signs is not None:
            _check_tensor(q.signs, "q.signs")
            if tuple(q.signs.shape) != (S2F6.block_size,):
                raise ValueError(f"q.signs has shape {tuple(q.signs.shape)}; expected ({S2F6.block_size},)")


__all__ = ["check_layout", "expected_layout"]
