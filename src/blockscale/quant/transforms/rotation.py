"""Rotations as data: a block-diagonal orthogonal matrix ``Q = blockdiag(M, ..., M)`` acting on consecutive
blocks of ``size`` along a tensor's last dim, with ``M = signed / sqrt(size)`` and ``signed`` an n x n
matrix of +1 / -1 entries whose rows are orthogonal (a Hadamard matrix), or ``M = I`` (kind "identity",
for tests: every rotated path then equals the unrotated one bit for bit).

Kinds (the names compressed-tensors' ``TransformScheme.type`` uses where one exists):

  "hadamard"         Sylvester ``H_n`` (``H_2n = [[H, H], [H, -H]]``), symmetric, n a power of two
  "random-hadamard"  ``diag(s) . H_n`` with signs ``s`` drawn from ``seed`` (``hadamard.random_signs``)
  "identity"         ``I_n``

The places a rotation acts, in compressed-tensors' conventions (``y = x W^T``; docs/formats.md):

  online input             ``apply(x)``          x -> x Q      (``unapply``: x -> x Q^T)
  fused into a weight's    ``fold_input(W)``     W -> W Q      ("weight_input", inverse=True): (x Q)(W Q)^T = x W^T
  input columns
  fused into a weight's    ``fold_output(W)``    W -> Q^T W, bias b -> Q^T b   ("weight_output"): y -> y Q
  output rows
  an embedding's output    ``apply(E)``          E -> E Q      ("weight_output" on an Embedding)

Fused folds compute in FP64 and round once to the weight's dtype; ``apply`` computes in FP32 (one GEMM per
block row, the same on every call) and casts back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .hadamard import hadamard_matrix, random_signs

ROTATION_KINDS = ("hadamard", "random-hadamard", "identity")
MAX_ROTATION_SIZE = 1 << 15


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True, eq=False)
class Rotation:
    """One rotation: its kind, block size and the ±1 matrix (``signed``, FP64; the identity for "identity").

    Build one with ``rotation(kind, size, seed)`` or, for a matrix read from a checkpoint,
    ``stored_rotation(kind, matrix)`` (validated)."""

    kind: str
    size: int
    signed: torch.Tensor = field(repr=False)
    seed: Optional[int] = None
    signs_after: bool = False  # "random-hadamard" as H . diag(s) (``transposed``) instead of diag(s) . H

    def transposed(self) -> "Rotation":
        """``M^T`` (also orthogonal). For "random-hadamard" that is ``H diag(s)``: the signs act after the Sylvester
        matrix, so a following Sylvester block-diagonal rotation cannot cancel it (``diag(s) H_64`` times
        ``blockdiag(H_16)`` is ``diag(s) (H_4 x I_16)`` up to scale: each output mixes only 4 inputs)."""
        return Rotation(self.kind, self.size, self.signed.T.contiguous(), self.seed, not self.signs_after)

    @property
    def normaliser(self) -> float:
        return 1.0 if self.kind == "identity" else math.sqrt(self.size)

    def matrix(self, dtype=torch.float64, device="cpu") -> torch.Tensor:
        """The orthogonal n x n block ``M`` (``signed / sqrt(n)``)."""
        m = self.signed if self.kind == "identity" else self.signed / math.sqrt(self.size)
        return m.to(dtype=dtype, device=device)

    def check_dim(self, dim: int, what: str) -> None:
        if dim % self.size:
            raise ValueError(f"{what}: size {dim} is not a multiple of the rotation's block size {self.size}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x Q`` over the last dim (online): FP32 GEMM per block (FP64 stays FP64), cast back to x's dtype."""
        self.check_dim(x.shape[-1], "rotated input")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = self.matrix(work, x.device)
        n = self.size
        y = x.to(work).reshape(-1, n) @ m
        return y.reshape(x.shape).to(x.dtype)

    def unapply(self, x: torch.Tensor) -> torch.Tensor:
        """``x Q^T`` over the last dim (the inverse of ``apply``), computed like ``apply``."""
        self.check_dim(x.shape[-1], "rotated input")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = self.matrix(work, x.device)
        y = x.to(work).reshape(-1, self.size) @ m.T
        return y.reshape(x.shape).to(x.dtype)

    def fold_input(self, weight: torch.Tensor) -> torch.Tensor:
        """``W Q`` (W [N, K], blocks along K) in FP64, rounded once to W's dtype."""
        self.check_dim(weight.shape[-1], "weight input columns")
        w = weight.detach().to(torch.float64)
        out = (w.reshape(-1, self.size) @ self.matrix()).reshape(w.shape)
        return out.to(weight.dtype)

    def fold_output(self, weight: torch.Tensor) -> torch.Tensor:
        """``Q^T W`` (W [N, ...], blocks along N; a bias [N] too) in FP64, rounded once to W's dtype."""
        self.check_dim(weight.shape[0], "weight output rows")
        w = weight.detach().to(torch.float64)
        n = self.size
        blocks = w.reshape(w.shape[0] // n, n, -1)  # [N/n, n, rest]
        out = torch.einsum("ji,bjr->bir", self.matrix(), blocks).reshape(w.shape)
        return out.to(weight.dtype)

    def describe(self) -> str:
        seed = f" seed {self.seed}" if self.kind == "random-hadamard" else ""
        after = " (signs after H)" if self.signs_after and self.kind == "random-hadamard" else ""
        return f"{self.kind} {self.size}{seed}{after}"


def rotation(kind: str, size: int, seed: int = 0) -> Rotation:
    """A ``Rotation`` of ``kind`` (``ROTATION_KINDS``) over blocks of ``size`` (a power of two up to 32768;
    "random-hadamard": signs from ``seed``)."""
    if kind not in ROTATION_KINDS:
        raise ValueError(f"rotation kind={kind!r}; allowed: {', '.join(ROTATION_KINDS)}")
    if not isinstance(size, int) or isinstance(size, bool) or not _is_power_of_two(size) \
            or size > MAX_ROTATION_SIZE:
        raise ValueError(f"rotation size={size!r}: must be a power of two from 1 to {MAX_ROTATION_SIZE}")
    if kind == "identity":
        return Rotation(kind, size, torch.eye(size, dtype=torch.float64))
    h = hadamard_matrix(size).to(torch.float64)
    if kind == "hadamard":
        return Rotation(kind, size, h)
    s = random_signs(size, seed=seed).to(torch.float64)
    return Rotation(kind, size, s[:, None] * h, seed=int(seed))


def stored_rotation(kind: str, matrix: torch.Tensor, what: str = "rotation matrix") -> Rotation:
    """A ``Rotation`` from a ±1 matrix read from a checkpoint (compressed-tensors stores online transforms
    unnormalised): square, entries exactly +1 / -1, rows orthogonal (``M M^T = n I`` exactly); "hadamard"
    must be Sylvester's. Raises ValueError naming ``what`` otherwise."""
    if kind not in ("hadamard", "random-hadamard"):
        raise ValueError(f"{what}: transform type {kind!r}; allowed: hadamard, random-hadamard")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 1 \
            or matrix.shape[0] > MAX_ROTATION_SIZE:
        raise ValueError(f"{what}: must be a square matrix of size 1..{MAX_ROTATION_SIZE}, "
                         f"got shape {tuple(matrix.shape)}")
    if not matrix.dtype.is_floating_point and matrix.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{what}: dtype {matrix.dtype} is not numeric")
    m = matrix.to(torch.float64)
    n = m.shape[0]
    if not bool(((m == 1) | (m == -1)).all()):
        raise ValueError(f"{what}: entries must be exactly +1 or -1 (stored unnormalised)")
    if not torch.equal(m @ m.T, n * torch.eye(n, dtype=torch.float64)):
        raise ValueError(f"{what}: rows are not orthogonal (not a Hadamard matrix)")
    if kind == "hadamard" and not (_is_power_of_two(n) and torch.equal(m, hadamard_matrix(n).to(torch.float64))):
        raise ValueError(f"{what}: type 'hadamard' must hold Sylvester's H_{n}")
    return Rotation(kind, n, m.contiguous())


def largest_power_of_two_divisor(n: int, cap: int = MAX_ROTATION_SIZE) -> int:
    """The largest power of two dividing ``n`` (at most ``cap``): the block of a "full" rotation over a dim
    that is not itself a power of two (576 -> 64, 1536 -> 512)."""
    if n < 1:
        raise ValueError(f"n={n!r} must be positive")
    return min(n & -n, cap)
