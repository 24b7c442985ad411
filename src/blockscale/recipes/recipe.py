"""Recipes as data: which quantizer each operand of each GEMM of a linear layer gets, plus model rules.

A linear layer ``y = x W^T`` runs three GEMMs, each written as ``A @ B^T`` with both operands
quantized along their last dim (the reduction dim):

    fprop  y  = x  @ W^T        A = x    [M, K]   B = W    [N, K]
    dgrad  dx = dy @ W          A = dy   [M, N]   B = W^T  [K, N]
    wgrad  dW = dy^T @ x        A = dy^T [N, M]   B = x^T  [K, M]

An operand spec of ``None`` means "not quantized": the operand is cast to ``unquantized_dtype``
(bf16 by default, as a tensor core would read it). Products accumulate in FP32.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from ..quant import FormatSpec, format_of, is_spec, spec_types
OPERANDS = ("fprop_input", "fprop_weight", "dgrad_grad", "dgrad_weight", "wgrad_grad", "wgrad_input")
UNQUANTIZED_DTYPES = ("bfloat16", "float32")
HADAMARD_SIGNS = ("te", "random")
# Modules kept in high precision by default: embeddings, the output head, MoE routers, Qwen2-MoE's
# shared_expert_gate (a Linear H -> 1 that vLLM's Qwen2MoeSparseMoeBlock builds as a plain torch.nn.Linear,
# never quantized).
DEFAULT_EXCLUDE = (r"embed", r"(^|\.)(lm_head|output|classifier)$", r"router", r"(^|\.)(shared_expert_)?gate$")


def check_patterns(patterns) -> tuple[str, ...]:
    """``patterns`` as a tuple of valid regular expressions (ValueError naming a bad one)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    for pat in patterns:
        try:
            re.compile(pat)
        except (re.error, TypeError) as exc:
            raise ValueError(f"exclude pattern {pat!r} is not a valid regular expression: {exc}") from None
    return tuple(patterns)


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class LinearRecipe:
    """Operand quantizers of one linear layer's three GEMMs (see the module docstring).

    wgrad_hadamard: 0 (off) or 16/32/64/128: random Hadamard transform of both wgrad operands
      along the token dim (it cancels in the product, and spreads outliers before quantizing).
    hadamard_signs: "te" (Transformer Engine's fixed 16-point vector; n must be 16) or "random"
      (redrawn every backward call from torch's generator, as Quartet II).
    reuse_fprop_weight: dgrad uses the forward's quantized weight, transposed, instead of
      re-quantizing (exact for 16x16 weight blocks, which commute with transposition).
    """

    fprop_input: Optional[FormatSpec] = None
    fprop_weight: Optional[FormatSpec] = None
    dgrad_grad: Optional[FormatSpec] = None
    dgrad_weight: Optional[FormatSpec] = None
    wgrad_grad: Optional[FormatSpec] = None
    wgrad_input: Optional[FormatSpec] = None
    wgrad_hadamard: int = 0
    hadamard_signs: str = "te"
    reuse_fprop_weight: bool = False
    unquantized_dtype: str = "bfloat16"

    def __post_init__(self):
        for name in OPERANDS:
            v = getattr(self, name)
            if v is None:
                continue
            if not is_spec(v):
                allowed = " / ".join(t.__name__ for t in spec_types())
                raise ValueError(f"{name} must be a blockscale {allowed} spec or None, got {v!r}")
            if format_of(v).blocked_dim(v) != -1:
                raise ValueError(f"{name}: operands are quantized along their reduction (last) dim; "
                                 f"use {type(v).__name__}(dim=-1)")
        _check("wgrad_hadamard", self.wgrad_hadamard, (0, 16, 32, 64, 128))
        _check("hadamard_signs", self.hadamard_signs, HADAMARD_SIGNS)
        if self.hadamard_signs == "te" and self.wgrad_hadamard not in (0, 16):
            raise ValueError("hadamard_signs='te' is a 16-point vector: use wgrad_hadamard=16 or signs 'random'")
        _check("unquantized_dtype", self.unquantized_dtype, UNQUANTIZED_DTYPES)
        if self.reuse_fprop_weight and self.dgrad_weight is not None:
            raise ValueError("reuse_fprop_weight=True takes dgrad's weight from the forward: set dgrad_weight=None")

    @property
    def quantized(self) -> bool:
        return any(getattr(self, n) is not None for n in OPERANDS)


@dataclass(frozen=True)
class Recipe:
    """A training recipe: the linear-layer recipe plus model-level rules.

    exclude: regular expressions (``re.search`` on the module's qualified name) of linear layers
      left untouched (embeddings, output head and routers by default).
    last_blocks_fraction / last_blocks_recipe: the last ``round(n_blocks * fraction)`` transformer
      blocks use the named built-in recipe's linear layers instead (e.g. 1/6 in "mxfp8").
    """

    name: str
    linear: LinearRecipe = field(default_factory=LinearRecipe)
    exclude: tuple = DEFAULT_EXCLUDE
    last_blocks_fraction: float = 0.0
    last_blocks_recipe: Optional[str] = None
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.linear, LinearRecipe):
            raise ValueError(f"linear must be a LinearRecipe, got {type(self.linear).__name__}")
        object.__setattr__(self, "exclude", check_patterns(self.exclude))
        if not (isinstance(self.last_blocks_fraction, (int, float)) and 0.0 <= self.last_blocks_fraction <= 1.0):
            raise ValueError(f"last_blocks_fraction={self.last_blocks_fraction!r} must be a number in [0, 1]")
        if self.last_blocks_fraction > 0 and not self.last_blocks_recipe:
            raise ValueError("last_blocks_fraction > 0 needs last_blocks_recipe (e.g. 'bf16' or 'mxfp8')")

    def n_last_blocks(self, n_blocks: int) -> int:
        """How many of ``n_blocks`` trailing blocks use ``last_blocks_recipe`` (round half up)."""
        return min(n_blocks, math.floor(n_blocks * self.last_blocks_fraction + 0.5))

    def with_(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)
