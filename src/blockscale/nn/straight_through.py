"""Straight-through activation quantization: the forward is the quantizer's output bit for bit, the
backward the identity, so gradients reach the layers before a quantized input (distillation and scale
learning train through FP8 / MX / NVFP4 activations; a plain fake_quantize has no gradient)."""
from __future__ import annotations

from typing import Callable

import torch


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def straight_through(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` (e.g. a layer's ``quantize_input``); with gradients on for ``x``, dL/dx = dL/dfn(x)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, fn)
    return fn(x)


__all__ = ["straight_through"]
