"""Quantized GEMM operands and the GEMM itself (``A @ B^T``), per backend.

An operand is prepared once (``prepare_operand``): quantized to its spec along the last (reduction)
dim, or cast to the unquantized dtype. The emulated GEMM dequantizes and multiplies in FP32 (the
accumulation precision of block-scaled tensor cores). A real low-precision kernel (e.g.
``torch._scaled_mm`` with block scales on GPUs that have it) registers itself with
``register_gemm_backend`` and receives the packed operands instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..quant import QuantizedTensor, fake_quantize, format_of
from ..quant.dispatch import quantize_with_values

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class Operand:
    """A GEMM operand: a QuantizedTensor (``q``) and/or its values (``t``: the dequantized FP32
    values, or the operand cast to the unquantized dtype)."""

    q: Optional[QuantizedTensor] = None
    t: Optional[torch.Tensor] = None

    def values(self) -> torch.Tensor:
        """The operand's values in FP32 (what an FP32-accumulating tensor core multiplies)."""
        return self.t.to(torch.float32) if self.t is not None else self.q.dequantize(torch.float32)

    def pack(self) -> tuple[list, tuple | None]:
        """(tensors to save for backward, metadata): packed codes and scales (values dropped: that
        is the memory saving), or the cast tensor."""
        if self.q is None:
            return [self.t], None
        q = self.q
        present = tuple(n for n in format_of(q.spec).fields if getattr(q, n) is not None)
        return [q.codes, q.scales] + [getattr(q, n) for n in present], (q.spec, q.shape, q.dtype, present)

    @staticmethod
    def unpack(tensors, meta) -> "Operand":
        """Inverse of ``pack``."""
        if meta is None:
            return Operand(t=tensors[0])
        spec, shape, dtype, present = meta
        kw = dict(zip(("codes", "scales") + present, tensors))
        return Operand(q=QuantizedTensor(spec=spec, shape=shape, dtype=dtype, **kw))


def prepare_operand(x: torch.Tensor, spec, unquantized_dtype: str, generator=None, keep_codes: bool = False) -> Operand:
    """Quantize ``x`` along its last dim to ``spec`` (or cast it, spec None). Only the dequantized
    values are produced unless ``keep_codes`` (an operand saved for backward)."""
    if spec is None:
        return Operand(t=x.detach().to(_DTYPES[unquantized_dtype]))
    keep_codes = keep_codes or _NEEDS_CODES[_ACTIVE["name"]]
    # Operands are checked once where they enter (the model's loss shows a NaN anyway); a full
    # isfinite pass per GEMM operand would cost as much as the quantizer's own amax pass.
    if keep_codes:
        q, v = quantize_with_values(x.detach(), spec, generator=generator, check_finite=False)
        return Operand(q=q, t=v)
    return Operand(t=fake_quantize(x.detach(), spec, generator, dtype=torch.float32, check_finite=False))


def emulated_gemm(a: Operand, b: Operand) -> torch.Tensor:
    """A @ B^T from dequantized FP32 operands, FP32 result."""
    return a.values() @ b.values().transpose(0, 1)


_GEMM_BACKENDS: dict[str, Callable[[Operand, Operand], torch.Tensor]] = {"emulated": emulated_gemm}
_NEEDS_CODES = {"emulated": False}
_ACTIVE = {"name": "emulated"}


def register_gemm_backend(name: str, fn: Callable[[Operand, Operand], torch.Tensor], needs_codes: bool = True) -> None:
    """Add a GEMM implementation ``fn(a, b) -> FP32 A @ B^T`` (it must equal the emulation's math).

    ``needs_codes``: every quantized operand then arrives with ``a.q`` (packed codes, block scales,
    outer scale: what a block-scaled tensor-core kernel reads), not only dequantized values.
    """
    _GEMM_BACKENDS[name] = fn
    _NEEDS_CODES[name] = needs_codes


def set_gemm_backend(name: str) -> None:
    if name not in _GEMM_BACKENDS:
        raise ValueError(f"gemm backend {name!r} is not registered; available: {', '.join(_GEMM_BACKENDS)}")
    _ACTIVE["name"] = name


def gemm_backend() -> str:
    """Name of the active GEMM backend."""
    return _ACTIVE["name"]


def gemm(a: Operand, b: Operand) -> torch.Tensor:
    """A @ B^T with the active backend (FP32 out)."""
    return _GEMM_BACKENDS[_ACTIVE["name"]](a, b)
