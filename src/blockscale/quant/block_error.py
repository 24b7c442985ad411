"""Quantization error of a block, summed in one fixed order shared by every implementation.

The 4/6 choice compares two nearly equal sums, so the FP32 summation order decides near-ties.
Order used everywhere (reference, compiled, future kernels):

* 1x16 blocks: a pairwise tree, ``v[0:n/2] + v[n/2:n]`` repeated until one value is left.
* 16x16 tiles: ``P = V + V^T`` (elementwise, so P is identical for a tile and its transpose),
  the same tree over P's 256 entries in row-major order, then x0.5 (exact). This makes the 4/6
  decision, and so the whole 2D quantization, commute with transposition.

Errors: "mse" = sum d^2, "mae" = sum |d|, "maxabs" = max |d|, d = dequantized - original (FP32).
"""
from __future__ import annotations

import torch


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by halving: v[:h] + v[h:] until one value is left."""
    n = v.shape[-1]
    if n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two length, got {n}")
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def tree_sum_terms(terms: list) -> torch.Tensor:
    """``tree_sum`` over a list of same-shape tensors (term i = position i): the same FP32 adds."""
    if len(terms) & (len(terms) - 1):
        raise ValueError(f"tree_sum_terms needs a power-of-two count, got {len(terms)}")
    while len(terms) > 1:
        h = len(terms) // 2
        terms = [terms[i] + terms[i + h] for i in range(h)]
    return terms[0]


def _pointwise(d: torch.Tensor, error: str) -> torch.Tensor:
    return d * d if error == "mse" else torch.abs(d)


def block_error(d: torch.Tensor, error: str) -> torch.Tensor:
    """Error of each 1x16 block: ``d`` is [..., 16]; returns [...]."""
    if error == "maxabs":
        return torch.abs(d).amax(dim=-1)
    return tree_sum(_pointwise(d, error))


def block_error_terms(ds: list, error: str) -> torch.Tensor:
    """``block_error`` from a list of 16 tensors, ``ds[i]`` = d at position i of every block.

    Identical bits to ``block_error``; this form lets a compiler fuse the whole block error
    into one pass instead of materialising d.
    """
    if error == "maxabs":
        out = torch.abs(ds[0])
        for d in ds[1:]:
            out = torch.maximum(out, torch.abs(d))
        return out
    return tree_sum_terms([_pointwise(d, error) for d in ds])


def tile_error(d: torch.Tensor, error: str) -> torch.Tensor:
    """Error of each 16x16 tile: ``d`` is [..., 16, 16] (rows, cols); returns [...]; transpose-invariant."""
    if error == "maxabs":
        return torch.abs(d).amax(dim=(-2, -1))
    v = _pointwise(d, error)
    p = v + v.transpose(-1, -2)
    return tree_sum(p.flatten(-2)) * 0.5
