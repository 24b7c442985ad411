"""The registered fused-experts layouts (``ExpertsLayout``), in the order a module is offered to them.

Adding an MoE family whose experts are neither the standard fused layout nor gpt-oss's: one file defining
its ``ExpertsLayout`` and one entry in ``EXPERTS_LAYOUTS`` (before ``FUSED_LAYOUT``, which claims every module
with fused 3-D expert parameters).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .experts_layout import ExpertsLayout
from .fused_experts_layout import FUSED_LAYOUT
from .gpt_oss_experts_layout import GPT_OSS_LAYOUT

EXPERTS_LAYOUTS: tuple[ExpertsLayout, ...] = (GPT_OSS_LAYOUT, FUSED_LAYOUT)


def experts_layout_of(module: nn.Module) -> Optional[ExpertsLayout]:
    """The layout claiming ``module`` (whether or not its ``why_not`` accepts it), None when none does."""
    return next((lay for lay in EXPERTS_LAYOUTS if lay.claims(module)), None)


def supported_experts_layout(module: nn.Module) -> Optional[ExpertsLayout]:
    """The layout of ``module`` when it claims it and accepts it, else None."""
    lay = experts_layout_of(module)
    return lay if lay is not None and lay.why_not(module) is None else None


def experts_layout_named(name: str) -> ExpertsLayout:
    """The layout called ``name``; ValueError naming the known ones."""
    for lay in EXPERTS_LAYOUTS:
        if lay.name == name:
            return lay
    raise ValueError(f"layout={name!r}; allowed values: {', '.join(repr(lay.name) for lay in EXPERTS_LAYOUTS)}")


__all__ = ["EXPERTS_LAYOUTS", "experts_layout_named", "experts_layout_of", "supported_experts_layout"]
