"""How a learner holds its latent FP32 weight: the units the optimizer steps the weight in.

    weight_units="raw"    the weight itself, ``weight`` [..., N, K]: Adam moves each element by about ``lr``
                          per step, so one lr is a different share of a quantization step on every model (and
                          on every block: a block with small weights moves as far as one with large ones).
    weight_units="block"  ``weight = weight_relative * unit`` with ``unit`` [..., N, K/16] (a buffer) the power of
                          two at or below the block's scale at the start (the stored E4M3 scale in real units,
                          s_e / S), clamped to [2^-100, 1]. Adam moves ``weight_relative`` by about ``lr`` per
                          step, so the weight moves by about ``lr`` times its block's scale (to within a factor 2):
                          the same share of a quantization step on every block of every model. The unit being a
                          power of two, ``weight_relative = weight / unit`` is exact and step 0 reproduces the
                          weight bit for bit.

The learner's forward and export read ``latent_weight()``; ``weight_parameter()`` is the tensor that trains.
"""
from __future__ import annotations

import torch
from torch import nn

WEIGHT_UNITS = ("raw", "block")
UNIT_MIN_EXP, UNIT_MAX_EXP = -100, 0
WEIGHT_PARAMETER_NAMES = ("weight", "weight_relative")


def check_weight_units(weight_units: str) -> None:
    if weight_units not in WEIGHT_UNITS:
        raise ValueError(f"weight_units={weight_units!r}; allowed values: {', '.join(WEIGHT_UNITS)}")


def block_units(block_scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or below each real-unit block scale [..., nb] (FP32), clamped to [2^-100, 1] (a zero
    scale gives 2^-100)."""
    s = block_scale.detach().float()
    exp = torch.floor(torch.log2(torch.where(s > 0, s, torch.full_like(s, 2.0 ** UNIT_MIN_EXP))))
    return torch.exp2(exp.clamp(UNIT_MIN_EXP, UNIT_MAX_EXP))


class LatentWeight:
    """A mixin for the learners (``nn.Module`` subclasses): ``init_latent_weight`` registers the FP32 weight as the
    parameter ``weight`` (raw units); ``use_block_units(block_scale)`` re-expresses it as ``weight_relative`` times
    the per-block power-of-two ``unit`` (see the module docstring)."""

    weight_units = "raw"

    def init_latent_weight(self, w: torch.Tensor, train: bool) -> None:
        self.weight = nn.Parameter(w.detach().to(torch.float32).clone(), requires_grad=train)

    @torch.no_grad()
    def use_block_units(self, block_scale: torch.Tensor) -> None:
        """Train the weight in units of ``block_scale`` [..., N, K/16] (real units: stored E4M3 scale / S): step 0
        keeps the weight bit for bit (ValueError when it cannot, e.g. a weight beyond 2^27 in a tiny block)."""
        if self.weight_units == "block":
            raise ValueError("the latent weight is in block units already")
        w = self.weight.detach()
        unit = block_units(block_scale)
        if tuple(unit.shape) != (*w.shape[:-1], w.shape[-1] // 16):
            raise ValueError(f"block_scale shape {tuple(block_scale.shape)}; the weight {tuple(w.shape)} needs "
                             f"{(*w.shape[:-1], w.shape[-1] // 16)}")
        rel = (w.reshape(*unit.shape, 16) / unit.unsqueeze(-1)).reshape(w.shape)
        back = (rel.reshape(*unit.shape, 16) * unit.unsqueeze(-1)).reshape(w.shape)
        if not (bool(torch.isfinite(rel).all()) and torch.equal(back, w)):
            raise ValueError("weight_units='block': the latent weight is not representable exactly in units of its "
                             "block scales (an element far larger than its block's scale)")
        train = self.weight.requires_grad
        del self.weight
        self.register_buffer("unit", unit)
        self.weight_relative = nn.Parameter(rel, requires_grad=train)
        self.weight_units = "block"

    def weight_parameter(self) -> nn.Parameter:
        """The parameter the optimizer moves: ``weight`` (raw) or ``weight_relative`` (block units)."""
        return self.weight_relative if self.weight_units == "block" else self.weight

    def latent_weight(self) -> torch.Tensor:
        """The FP32 latent weight [..., N, K] (differentiable w.r.t. ``weight_parameter()``)."""
        if self.weight_units == "raw":
            return self.weight
        rel = self.weight_relative
        return (rel.reshape(*self.unit.shape, 16) * self.unit.unsqueeze(-1)).reshape(rel.shape)


__all__ = ["LatentWeight", "WEIGHT_PARAMETER_NAMES", "WEIGHT_UNITS", "block_units", "check_weight_units"]
