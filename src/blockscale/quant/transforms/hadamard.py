"""Random Hadamard transform (RHT) over blocks of n along one dim.

``hadamard(x) = x_blocks @ (diag(s) . H_n / sqrt(n))`` with Sylvester ``H_n``: computed as sign
flip (exact), a fast Walsh-Hadamard butterfly in a fixed order (``H_2n = [[H, H], [H, -H]]``), then
one multiply by FP32(1/sqrt(n)). The matrix is orthogonal (and symmetric up to the signs), so
``inverse_hadamard`` (butterfly, scale, then signs) undoes it up to FP32 rounding of the sums.
"""
from __future__ import annotations

import math

import torch

from ..backend import want_compiled
from ..fast_kernel import fast_kernel

HADAMARD_SIZES = (16, 32, 64, 128)
# Transformer Engine's fixed 16-point sign vector (bit i set -> s_i = -1): mask 0xD7E8.
TE_SIGNS_16 = tuple(-1.0 if (0xD7E8 >> i) & 1 else 1.0 for i in range(16))


def _check_n(n: int) -> None:
    if n not in HADAMARD_SIZES:
        raise ValueError(f"n={n!r} is not supported; allowed values: {', '.join(map(str, HADAMARD_SIZES))}")


def random_signs(n: int, seed: int | None = None, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    """A ±1 FP32 vector of length ``n`` drawn from ``seed`` (or ``generator``)."""
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    bits = torch.randint(0, 2, (n,), generator=generator)
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester H_n (entries ±1), FP32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rht_matrix(n: int, signs=None, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The n x n matrix diag(signs) . H_n / sqrt(n) of ``hadamard`` (signs None: plain H_n / sqrt(n))."""
    _check_n(n)
    m = hadamard_matrix(n).to(torch.float64) / math.sqrt(n)
    s = _signs_tensor(signs, n, "cpu")
    if s is not None:
        m = s.to(torch.float64)[:, None] * m
    return m.to(dtype=dtype, device=device)


def hadamard_gemm(x: torch.Tensor, n: int = 16, signs=None) -> torch.Tensor:
    """``hadamard`` along the last dim as one GEMM, ``x_blocks @ rht_matrix(n, signs)``: the same
    transform, with the BLAS's summation order instead of the butterfly's (bits may differ from
    ``hadamard`` by FP32 rounding; deterministic for a given shape). Used where speed matters more
    than matching the butterfly, e.g. the wgrad operands of a training step."""
    if x.shape[-1] % n:
        raise ValueError(f"hadamard_gemm: last dim {x.shape[-1]} is not a multiple of n={n}")
    m = rht_matrix(n, signs, dtype=x.dtype, device=x.device)
    return (x.reshape(-1, n) @ m).reshape(x.shape)


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform over the last dim (length n, a power of two)."""
    n = v.shape[-1]
    h = 1
    lead = v.shape[:-1]
    while h < n:
        w = v.reshape(*lead, n // (2 * h), 2, h)
        a, b = w[..., 0, :], w[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return v


def _blocks(x: torch.Tensor, n: int, dim: int):
    xd = x.movedim(dim, -1)
    if xd.shape[-1] % n:
        raise ValueError(f"hadamard: size {xd.shape[-1]} of dim {dim} is not a multiple of n={n}")
    return xd.reshape(*xd.shape[:-1], xd.shape[-1] // n, n)


def _signs_tensor(signs, n: int, device) -> torch.Tensor | None:
    if signs is None:
        return None
    s = torch.as_tensor(signs, dtype=torch.float32, device=device)
    if s.shape != (n,) or not bool(((s == 1) | (s == -1)).all()):
        raise ValueError(f"signs must be a length-{n} vector of +1/-1 values, got shape {tuple(s.shape)}")
    return s


def rht_blocks(v: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """Kernel: blocks [..., n] -> (v * signs) butterflied, times FP32(1/sqrt(n)). No checks."""
    if signs is not None:
        v = v * signs.to(v.dtype)
    return _butterfly(v) * (1.0 / math.sqrt(v.shape[-1]))


def inverse_rht_blocks(v: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """Kernel: inverse of ``rht_blocks``."""
    v = _butterfly(v) * (1.0 / math.sqrt(v.shape[-1]))
    return v if signs is None else v * signs.to(v.dtype)


_rht_fast = fast_kernel(rht_blocks)
_inverse_rht_fast = fast_kernel(inverse_rht_blocks)


def hadamard(x: torch.Tensor, n: int = 16, signs=None, dim: int = -1) -> torch.Tensor:
    """x' = x_blocks @ (diag(signs) . H_n / sqrt(n)) over consecutive blocks of ``n`` along ``dim``.

    signs: None (plain H_n), a length-n ±1 sequence, e.g. ``TE_SIGNS_16`` or ``random_signs(n, seed)``.
    FP32 (or FP64) in, same dtype out; bf16 / fp16 are computed in FP32 and cast back.
    """
    _check_n(n)
    dtype = x.dtype
    work = x if dtype in (torch.float32, torch.float64) else x.float()
    v = _blocks(work, n, dim)
    kernel = _rht_fast if want_compiled(v.numel(), _rht_fast) else _rht_fast.eager
    v = kernel(v, _signs_tensor(signs, n, x.device))
    return v.reshape(*v.shape[:-2], -1).movedim(-1, dim).to(dtype)


def inverse_hadamard(x: torch.Tensor, n: int = 16, signs=None, dim: int = -1) -> torch.Tensor:
    """Inverse of ``hadamard`` with the same ``n``, ``signs`` and ``dim``: x = (x' @ H_n / sqrt(n)) . signs."""
    _check_n(n)
    dtype = x.dtype
    work = x if dtype in (torch.float32, torch.float64) else x.float()
    v = _blocks(work, n, dim)
    kernel = _inverse_rht_fast if want_compiled(v.numel(), _inverse_rht_fast) else _inverse_rht_fast.eager
    v = kernel(v, _signs_tensor(signs, n, x.device))
    return v.reshape(*v.shape[:-2], -1).movedim(-1, dim).to(dtype)
