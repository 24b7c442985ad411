"""``RotationPlan``: which rotations a PTQ run applies, parsed from ``--rotate`` (``parse_rotate``).

  none       nothing
  r4         online Hadamard on every ``down_proj`` input (SpinQuant's R4), its inverse fused into down_proj
  r1r2       fused only: R1 on the residual stream (norm weights folded into the following Linears,
             embeddings and lm_head rotated, lm_head untied) and R2 per attention head between v_proj and o_proj
  r1r2r4     both
  r3         SpinQuant's R3: the KV cache quantizes keys after a Hadamard of head_dim (queries and keys rotated after
             RoPE; it cancels in q k^T, so it only changes anything with a recipe's ``kv_cache``); joins the others
             as ``r1r2r3r4`` or ``r3+mr``
  quip       online Hadamard on every decoder Linear's input (QuIP's "v"), over the largest power-of-two block
             dividing its in_features (full when in_features is a power of two: 576 -> 64, 1536 -> 512)
  block:N    the same over blocks of N (a power of two)
  mr         MR-GPTQ's rotation: the same over blocks equal to each Linear's quantization group (16 for NVFP4,
             32 for MX; Linears of other schemes stay unrotated)

Tokens join with "+" (``r1r2+block:16``: fused R1 / R2 and online block-16 input rotations); R4 cannot be
combined with an input rotation of every Linear (down_proj would get two). Fused rotations are random
Hadamard (seeded signs: ``seed``); online ones Sylvester Hadamard (what vLLM's hadacore kernel computes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from ...errors import UsageError
from ...quant.transforms.rotation import MAX_ROTATION_SIZE, ROTATION_KINDS

ROTATE_CHOICES = ("none", "r4", "r1r2", "r1r2r4", "r3", "r1r2r3r4", "quip", "block:N", "mr")
_FUSED_TOKEN = re.compile(r"^(r[1-4])+$")  # r1, r2, r3, r4 and their concatenations (r1r2r4, r1r2r3r4)


@dataclass(frozen=True)
class RotationPlan:
    """r1 / r2: fused; r3: keys rotated for KV-cache quantization; r4: online on down_proj; inputs: online on every decoder Linear's input: None,
    "full" (largest power-of-two block of in_features), "group" (the scheme's quantization group) or a block
    size. fused_kind / online_kind: ``quant.transforms.rotation.ROTATION_KINDS`` ("identity" for tests)."""

    r1: bool = False
    r2: bool = False
    r4: bool = False
    r3: bool = False
    inputs: Optional[Union[str, int]] = None
    seed: int = 0
    fused_kind: str = "random-hadamard"
    online_kind: str = "hadamard"

    def __post_init__(self):
        for name in ("r1", "r2", "r3", "r4"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"RotationPlan {name}={getattr(self, name)!r}: expected True or False")
        if self.inputs is not None and self.inputs not in ("full", "group"):
            n = self.inputs
            if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1) or n > MAX_ROTATION_SIZE:
                raise UsageError(f"RotationPlan inputs={n!r}: expected None, 'full', 'group' or a power of two "
                                 f"from 2 to {MAX_ROTATION_SIZE}")
        if self.r4 and self.inputs is not None:
            raise UsageError("rotate: r4 cannot be combined with quip / block:N / mr (down_proj's input would be "
                             "rotated twice); the input rotation of every Linear already covers down_proj")
        for name in ("fused_kind", "online_kind"):
            if getattr(self, name) not in ROTATION_KINDS:
                raise UsageError(f"RotationPlan {name}={getattr(self, name)!r}; allowed: {', '.join(ROTATION_KINDS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"RotationPlan seed={self.seed!r}: expected a non-negative int")

    @property
    def any(self) -> bool:
        return self.r1 or self.r2 or self.r3 or self.r4 or self.inputs is not None

    @property
    def online(self) -> bool:
        """Whether the plan has rotations applied at run time (R3, R4, input rotations): checkpoints must say so."""
        return self.r3 or self.r4 or self.inputs is not None

    @property
    def label(self) -> str:
        """The ``--rotate`` text this plan parses from ("none" when it rotates nothing)."""
        fused = "".join(t for t, on in (("r1", self.r1), ("r2", self.r2), ("r3", self.r3), ("r4", self.r4)) if on)
        inputs = {None: "", "full": "quip", "group": "mr"}.get(self.inputs, f"block:{self.inputs}")
        return "+".join(p for p in (fused, inputs) if p) or "none"


def parse_rotate(text: str, seed: int = 0) -> RotationPlan:
    """The plan of a ``--rotate`` value (``ROTATE_CHOICES``, or tokens joined with "+"). UsageError naming
    the allowed values otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"rotate={text!r}; allowed: {', '.join(ROTATE_CHOICES)} (tokens may be joined with '+')")
    text = text.strip().lower()
    if text == "none":
        return RotationPlan(seed=seed)
    flags: set[str] = set()
    inputs: Optional[Union[str, int]] = None
    for token in text.split("+"):
        if _FUSED_TOKEN.match(token):
            parts = re.findall(r"r[1-4]", token)
            if len(set(parts)) != len(parts) or flags & set(parts):
                raise UsageError(f"rotate={text!r}: {token!r} names a rotation twice")
            flags.update(parts)
            continue
        if token in ("quip", "mr") or token.startswith("block:"):
            if inputs is not None:
                raise UsageError(f"rotate={text!r}: one input rotation at most (quip, block:N or mr)")
            if token == "quip":
                inputs = "full"
            elif token == "mr":
                inputs = "group"
            else:
                n = token.split(":", 1)[1]
                if not n.isdigit():
                    raise UsageError(f"rotate={text!r}: block:N needs a power of two N (e.g. block:16)")
                inputs = int(n)
            continue
        raise UsageError(f"rotate={text!r}: unknown token {token!r}; allowed: {', '.join(ROTATE_CHOICES)} "
                         "(tokens may be joined with '+')")
    return RotationPlan(r1="r1" in flags, r2="r2" in flags, r3="r3" in flags, r4="r4" in flags, inputs=inputs,
                        seed=seed)
