"""QuantizedLinear: ``y = x W^T + b`` with every GEMM operand quantized as a LinearRecipe says.

Forward quantizes x and W (fprop operands) and saves the *quantized* tensors (packed codes and
scales: ~4.5 bits per value for NVFP4) instead of x. Backward dequantizes them, transposes, and
re-quantizes each along its new reduction dim for dgrad and wgrad (optionally after a random
Hadamard transform along the token dim for wgrad). Master weights stay in full precision; the
output has the input's dtype.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import TE_SIGNS_16, format_of, random_signs
from ..quant.transforms.hadamard import hadamard_gemm
from ..quant.transforms.requantize_transposed import fused_supported, nvfp4_to_mx_transposed
from ..recipes import LinearRecipe
from .gemm import Operand, gemm, gemm_backend, prepare_operand


def _rht_tokens(t: torch.Tensor, n: int, signs) -> torch.Tensor:
    """Random Hadamard transform along the last (token) dim, zero-padded to a multiple of n (zero
    tokens add nothing to dW), as one GEMM with the n x n matrix (it cancels in dy^T x anyway)."""
    pad = (-t.shape[-1]) % n
    if pad:
        t = F.pad(t, (0, pad))
    return hadamard_gemm(t.contiguous(), n=n, signs=signs)


def _fused_transposed(op: Operand, spec, generator) -> Operand | None:
    """The operand ``spec``-quantized along the other dim of a saved 2-D NVFP4 operand, i.e.
    ``prepare_operand(op.values().t().contiguous(), spec)``, from one fused Triton kernel
    (``quant.transforms.requantize_transposed.nvfp4_to_mx_transposed``: dequantize + transpose + MX quantize, nothing
    materialised); None where that kernel does not apply (CPU tensors, other formats): the caller
    then takes the unfused path. Same bits for RNE; stochastic rounding draws from Philox seeded by
    ``generator``, as every Triton kernel does."""
    if op.q is None:
        return None
    if not fused_supported(op.q, spec):
        return None
    q, v = nvfp4_to_mx_transposed(op.q, spec, generator, outputs="both")
    return Operand(q=q, t=v)


def _along_any_dim(spec) -> bool:
    """The spec's format blocks along a chosen dim (``Format.blocks_along_any_dim``: MX)."""
    return spec is not None and format_of(spec).blocks_along_any_dim


def _tokens_dim_ok(r: LinearRecipe) -> bool:
    """wgrad operands can be quantized along the token dim in place (formats with a ``dim``: MX; no
    Hadamard; emulated GEMM)."""
    return (not r.wgrad_hadamard and _along_any_dim(r.wgrad_grad) and _along_any_dim(r.wgrad_input)
            and gemm_backend() == "emulated")


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearRecipe, generator):
        r = recipe
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        xa = prepare_operand(x2, r.fprop_input, r.unquantized_dtype, generator, keep_codes=True)
        wb = prepare_operand(weight, r.fprop_weight, r.unquantized_dtype, generator, keep_codes=True)
        y = gemm(xa, wb)
        if bias is not None:
            y = y + bias.to(torch.float32)
        (xt, ctx.x_meta), (wt, ctx.w_meta) = xa.pack(), wb.pack()
        ctx.save_for_backward(*xt, *wt)
        ctx.n_x = len(xt)
        ctx.recipe, ctx.generator, ctx.has_bias = r, generator, bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y.to(x.dtype).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        r, g = ctx.recipe, ctx.generator
        saved = ctx.saved_tensors
        x_op = Operand.unpack(saved[:ctx.n_x], ctx.x_meta)
        w_op = Operand.unpack(saved[ctx.n_x:], ctx.w_meta)
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        dx = dw = db = None
        w_vals = None
        if ctx.needs_input_grad[0]:
            # dgrad: dx = dy @ W = A @ B^T, A = dy [M, N], B = W^T [K, N]; both along N
            a = prepare_operand(dy2, r.dgrad_grad, r.unquantized_dtype, g)
            if r.reuse_fprop_weight:
                dx = a.values() @ w_op.values()  # the forward's quantized W, transposed: no re-quantization
            else:
                b = _fused_transposed(w_op, r.dgrad_weight, g)
                if b is None:
                    w_vals = w_op.values()
                    b = prepare_operand(w_vals.t().contiguous(), r.dgrad_weight, r.unquantized_dtype, g)
                dx = gemm(a, b)
            dx = dx.to(ctx.x_dtype).reshape(*dy.shape[:-1], -1)
        if ctx.needs_input_grad[1] and _tokens_dim_ok(r):
            # wgrad with MX operands and no rotation: quantize dy [M, N] and x^ [M, K] along dim 0
            # (the tokens) in place of transposing them first: the same blocks, values and random
            # draws, no transposed copies. dW = A^T B with A, B in their natural layout.
            a = prepare_operand(dy2.float(), dataclasses.replace(r.wgrad_grad, dim=0), r.unquantized_dtype, g)
            bt = _fused_transposed(x_op, r.wgrad_input, g)  # the same quantization, of x^ transposed
            if bt is not None:
                dw = (a.values().t() @ bt.values().t()).to(ctx.w_dtype)
            else:
                b = prepare_operand(x_op.values(), dataclasses.replace(r.wgrad_input, dim=0), r.unquantized_dtype, g)
                dw = (a.values().t() @ b.values()).to(ctx.w_dtype)
        elif ctx.needs_input_grad[1]:
            # wgrad: dW = dy^T @ x = A @ B^T, A = dy^T [N, M], B = x^T [K, M]; both along the tokens M
            at = dy2.t().float()
            bt = None
            if r.wgrad_hadamard:
                signs = TE_SIGNS_16 if r.hadamard_signs == "te" else random_signs(r.wgrad_hadamard, generator=g)
                at = _rht_tokens(at, r.wgrad_hadamard, signs)
                bt = _rht_tokens(x_op.values().t(), r.wgrad_hadamard, signs)
            a = prepare_operand(at.contiguous(), r.wgrad_grad, r.unquantized_dtype, g)
            b = None if r.wgrad_hadamard else _fused_transposed(x_op, r.wgrad_input, g)
            if b is None:
                bt = x_op.values().t() if bt is None else bt
                b = prepare_operand(bt.contiguous(), r.wgrad_input, r.unquantized_dtype, g)
            dw = gemm(a, b).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None


def quantized_linear(x, weight, bias, recipe: LinearRecipe, generator=None):
    """Functional form of ``QuantizedLinear``."""
    return _QuantizedLinearFn.apply(x, weight, bias, recipe, generator)


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs follow ``recipe`` (same parameters and state_dict keys).

    ``generator`` drives stochastic rounding and random Hadamard signs (None: torch's default
    generator, so a trainer that saves torch's RNG state resumes exactly).
    """

    def __init__(self, in_features, out_features, bias=True, recipe: LinearRecipe | None = None,
                 device=None, dtype=None, generator=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else LinearRecipe()
        self.generator = generator

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: LinearRecipe, generator=None) -> "QuantizedLinear":
        """A QuantizedLinear sharing ``linear``'s parameters (no copy)."""
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.weight = linear.weight
        q.bias = linear.bias
        q.recipe, q.generator = recipe, generator
        q._forward_hooks.update(linear._forward_hooks)
        q._forward_pre_hooks.update(linear._forward_pre_hooks)
        return q

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.recipe, self.generator)

    def extra_repr(self) -> str:
        r = self.recipe
        ops = ", ".join(f"{n}={type(getattr(r, n)).__name__ if getattr(r, n) is not None else r.unquantized_dtype}"
                        for n in ("fprop_input", "fprop_weight", "dgrad_grad", "wgrad_grad"))
        return f"{super().extra_repr()}, {ops}"
