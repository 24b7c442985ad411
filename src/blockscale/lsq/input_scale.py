"""W4A4: learning a Linear's activation outer scale (``lsq.enable(learn_input_scales=True)``).

An NVFP4 activation block's scale is dynamic, ``e4m3(min(amax_b * S / 6, 448))``, so the calibrated outer
scale S = 448 * 6 / amax_cal acts on the forward only through the E4M3 rounding of the block scales and
through saturation: a block whose amax exceeds alpha = 6 * 448 / S gets the largest scale 448 and its values
are clipped at +-alpha. Learning S is learning that clipping level (as PACT / LSQ+ learn an activation clip).

Parameter: ``log_input_amax`` (a scalar, 0 at the calibrated scale): alpha = alpha_cal * exp(theta), so
S' = S * exp(-theta) (S * 1 exactly at theta = 0: step 0 is bit for bit the PTQ model). Backward: the inputs
get the identity (as with fixed scales); theta gets the LSQ gradient of the saturated blocks' scale
s = alpha / 6 (x~ = q(x / s) * s there): dL/dtheta = sum over saturated blocks of g * (q - u * inside) * s
with u = x / s, inside = |u| <= 6; unsaturated blocks' scales follow their own amax and contribute 0.
Only the activation scale rule "6" (the 4/6 rule picks per block between two scales: not this formula).
"""
from __future__ import annotations

import torch

from ..quant import NVFP4
from ..quant.dispatch import fake_quantize

BLOCK = 16


class _LearnedInputScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, theta, S, error):
        S_new = S * torch.exp(-theta.detach())
        xq = fake_quantize(x, NVFP4(scale_rule="6", error=error), encode_scale=S_new, check_finite=False)
        ctx.save_for_backward(x, xq, S_new)
        return xq

    @staticmethod
    def backward(ctx, g):
        x, xq, S_new = ctx.saved_tensors
        K = x.shape[-1]
        xb = x.detach().float().reshape(-1, K // BLOCK, BLOCK)
        qb = xq.detach().float().reshape(-1, K // BLOCK, BLOCK)
        gb = g.float().reshape(-1, K // BLOCK, BLOCK)
        s = 448.0 / S_new.float().reshape(())  # the saturated blocks' scale in real units, alpha / 6
        saturated = (xb.abs().amax(-1, keepdim=True) * (S_new.float().reshape(()) / 6.0)) > 448.0
        u = xb / s
        inside = u.abs() <= 6.0
        term = torch.where(saturated, qb / s - torch.where(inside, u, torch.zeros_like(u)), torch.zeros_like(u))
        d_theta = (gb * term).sum() * s
        return g, d_theta.reshape(()).to(torch.float32), None, None


def learned_input_quantize(x: torch.Tensor, theta: torch.Tensor, S: torch.Tensor, error: str = "mse") -> torch.Tensor:
    """x fake-quantized with the outer scale S * exp(-theta) (see the module docstring for the gradient)."""
    return _LearnedInputScale.apply(x, theta, S.reshape(()), error)


def learned_input_scale(S: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """The FP32 outer scale S * exp(-theta) the forward uses (what ``freeze`` stores)."""
    return (S.float() * torch.exp(-theta.detach().float())).reshape(S.shape)


__all__ = ["learned_input_quantize", "learned_input_scale"]
