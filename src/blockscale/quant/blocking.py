"""Shared plumbing for block quantizers: padding to whole blocks and row chunks for eager code."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Eager kernels work on row chunks of about this many elements, so their temporaries stay in
# cache instead of allocating a full-size tensor per elementwise step.
CHUNK_ELEMENTS = 1 << 18


def pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` to a multiple of ``multiple`` (no copy when already aligned)."""
    n = x.shape[dim]
    extra = (-n) % multiple
    if extra == 0:
        return x
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def row_chunks(n_rows: int, row_elems: int, row_multiple: int = 1):
    """Yield ``slice`` objects covering ``range(n_rows)`` in chunks of about CHUNK_ELEMENTS elements."""
    rows = max(row_multiple, (CHUNK_ELEMENTS // max(row_elems, 1)) // row_multiple * row_multiple)
    for start in range(0, n_rows, rows):
        yield slice(start, min(start + rows, n_rows))


def draw_random(shape, rounding: str, sr_mode: str, generator, device) -> torch.Tensor | None:
    """Random numbers for stochastic rounding, drawn once for the whole (padded) tensor.

    "hardware": uint8 bits (uniform 64-bit integers viewed as 8 bytes each: 8x fewer generator
    calls than drawing bytes); "exact": FP32 uniforms with 24 random bits. None for "nearest".
    """
    if rounding == "nearest":
        return None
    shape = tuple(shape)
    if sr_mode == "hardware":
        n = math.prod(shape)
        words = torch.empty(((n + 7) // 8,), dtype=torch.int64, device=device)
        words.random_(-(2**63), 2**63 - 1, generator=generator)
        return words.view(torch.uint8)[:n].view(shape)
    return torch.rand(shape, dtype=torch.float32, generator=generator, device=device)


def random_from_bits(bits: torch.Tensor, shape, sr_mode: str) -> torch.Tensor:
    """Stochastic-rounding randoms from externally supplied uint32 draws (any int32/int64/uint32
    tensor of ``prod(shape)`` raw 32-bit patterns, one per element), e.g. those of a GPU kernel's
    Philox stream: "hardware" takes the top 8 bits, "exact" the top 24 bits as ``(bits >> 8) * 2**-24``.
    """
    b = bits.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    if b.numel() != math.prod(shape):
        raise ValueError(f"rand_bits has {b.numel()} values; expected {math.prod(shape)} (one per padded element)")
    b = b.view(tuple(shape))
    if sr_mode == "hardware":
        return (b >> 24).to(torch.uint8)
    return (b >> 8).to(torch.float32) * 2.0**-24  # exact: a 24-bit integer times a power of two


def triton_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """A Philox seed for a Triton kernel, drawn from ``generator`` (or the device's default one)."""
    dev = generator.device if generator is not None else device
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).item())


def abs_max(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| (FP32) over all of ``x`` or over ``dim``; 0 for an empty reduction. NaN propagates.

    One read of ``x`` (``aminmax``), no |x| temporary.
    """
    if x.numel() == 0:
        shape = () if dim is None else tuple(d for i, d in enumerate(x.shape) if i != dim % x.dim())
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(-lo, hi).to(torch.float32)
