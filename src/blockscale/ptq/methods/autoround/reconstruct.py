"""AutoRound's reconstruction of one decoder layer: sign-SGD on every quantized weight's rounding offsets V and
clip factors alpha (``grid``) so that the layer with fake-quantized weights (and, for W4A4 / W8A8 schemes, its
inputs quantized as the inference modules will) reproduces the full-precision layer's output.

    targets  y_b = layer(x_b) in full precision, for every calibration batch b at the layer's door
    step t   one batch b (a seeded random order); loss = mean((layer_q(x_b) - y_b)^2) in FP32;
             the parameters kept as the best when this loss is the lowest so far (before the step);
             p -= lr_t * sign(dloss/dp), lr_t = lr * (1 - t / iters); V clamped to [-0.5, 0.5],
             alpha to [min_clip, 1]
    guard    the best parameters' loss over all batches against the start's (V = 0, alpha = 1: round to
             nearest with the scale rule); the start is kept unless the learned ones are strictly lower,
             so the layer's calibration error is never above round to nearest's

What is learned: each Linear (``LinearLearner``) and each fused 3-D experts module (``ExpertsLearner``, the
standard layout and gpt-oss's: every expert's gate_up and down matrix, each on its own grid; an expert no
calibration token reaches gets no gradient and stays at its start). The activations' rounding passes the gradient straight
through. Norms, biases, routers and everything else in the layer keep their values.
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

from ....nn.experts_layout import shell_of
from ....nn.straight_through import straight_through as straight_through_input
from ...capture import to_device
from ...protocol import QuantizedWeight
from .grid import Grid, make_grid
from .options import AutoRoundOptions

_PROJ = ("gate_up", "down")


def _zeros(grid: Grid, lead: tuple = ()) -> torch.Tensor:
    """V at its start (0), for one grid or ``lead`` grids of the same shape stacked."""
    return torch.zeros((*lead, *grid.W.shape), dtype=torch.float32, device=grid.W.device, requires_grad=True)


def _ones(grid: Grid, clip: bool, lead: tuple = ()) -> Optional[torch.Tensor]:
    """alpha at its start (1), or None when the grid's scales stay fixed."""
    if not clip or grid.alpha_shape is None:
        return None
    return torch.ones((*lead, *grid.alpha_shape), dtype=torch.float32, device=grid.W.device, requires_grad=True)


class LinearLearner:
    """One Linear: ``rel`` its name inside the layer, its grid, V, alpha, its statistics name ``key`` and the
    input quantizer of its scheme (None: weights only)."""

    def __init__(self, rel: str, module: nn.Linear, grid: Grid, clip: bool, quantize_input=None, key: str = ""):
        self.rel, self.module, self.grid, self.key, self.quantize_input = rel, module, grid, key or rel, quantize_input
        self.V, self.alpha = _zeros(grid), _ones(grid, clip)

    def parameters(self) -> list[torch.Tensor]:
        return [self.V] + ([self.alpha] if self.alpha is not None else [])

    def state(self) -> tuple:
        return tuple(None if p is None else p.detach().clone() for p in (self.V, self.alpha))

    def weights(self, state: Optional[tuple] = None) -> dict[str, torch.Tensor]:
        V, alpha = state if state is not None else (self.V, self.alpha)
        return {f"{self.rel}.weight": self.grid.fake(V, alpha).to(self.module.weight.dtype)}

    def clamp(self, min_clip: float) -> None:
        self.V.clamp_(-0.5, 0.5)
        if self.alpha is not None:
            self.alpha.clamp_(min_clip, 1.0)

    def hook(self):
        """Quantize the Linear's inputs as its inference module will (straight-through); a handle, or None."""
        if self.quantize_input is None:
            return None
        fn = self.quantize_input
        return self.module.register_forward_pre_hook(lambda _m, args: (straight_through_input(args[0], fn), *args[1:]))

    def results(self, state: tuple) -> dict[str, QuantizedWeight]:
        q, latent = self.grid.final(*state)
        return {self.key: QuantizedWeight(q, latent=latent)}


class _Restore:
    def __init__(self, module):
        self.module = module

    def remove(self):
        self.module.__dict__.pop("forward", None)


class ExpertsLearner:
    """One fused-experts module of the standard layout (``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
    are its out x in matrices): a grid, V and alpha per expert and projection, stacked."""

    def __init__(self, rel: str, module: nn.Module, start, clip: bool):
        if start.layout.name not in ("fused", "gpt-oss"):
            raise ValueError(f"AutoRound has no parameter mapping for the {start.layout.name!r} experts layout")
        self.rel, self.module, self.start = rel, module, start
        self.transposed = start.layout.name == "gpt-oss"  # its parameters are the out x in matrices transposed
        W = dict(zip(_PROJ, start.layout.matrices(module)))
        self.grids = {p: [make_grid(W[p][e], start.q[p][e]) for e in range(W[p].shape[0])] for p in _PROJ}
        self.V = {p: _zeros(self.grids[p][0], (len(self.grids[p]),)) for p in _PROJ}
        self.alpha = {p: _ones(self.grids[p][0], clip, (len(self.grids[p]),)) for p in _PROJ}
        scheme, amax = start.scheme, start.input_amax
        self.quantizers = None
        if scheme.quantizes_activations:
            self.quantizers = {p: [scheme.input_quantizer(amax[p][e] if amax else 0.0) for e in range(len(W[p]))]
                               for p in _PROJ}

    def parameters(self) -> list[torch.Tensor]:
        return [self.V[p] for p in _PROJ] + [self.alpha[p] for p in _PROJ if self.alpha[p] is not None]

    def state(self) -> tuple:
        return tuple((self.V[p].detach().clone(), None if self.alpha[p] is None else self.alpha[p].detach().clone())
                     for p in _PROJ)

    def weights(self, state: Optional[tuple] = None) -> dict[str, torch.Tensor]:
        out = {}
        for k, p in enumerate(_PROJ):
            V, alpha = state[k] if state is not None else (self.V[p], self.alpha[p])
            dtype = getattr(self.module, f"{p}_proj").dtype
            w = torch.stack([g.fake(V[e], None if alpha is None else alpha[e]) for e, g in enumerate(self.grids[p])])
            out[f"{self.rel}.{p}_proj"] = (w.transpose(1, 2).contiguous() if self.transposed else w).to(dtype)
        return out

    def clamp(self, min_clip: float) -> None:
        for p in _PROJ:
            self.V[p].clamp_(-0.5, 0.5)
            if self.alpha[p] is not None:
                self.alpha[p].clamp_(min_clip, 1.0)

    def hook(self):
        """W4A4 / W8A8: the layout's eager routing loop with each expert's inputs quantized (straight-through)."""
        if self.quantizers is None:
            return None
        m, layout, qs, t = self.module, self.start.layout, self.quantizers, self.transposed
        ex = m if not t else SimpleNamespace(_hf_shell=shell_of(m), gate_up_proj_bias=m.gate_up_proj_bias,
                                             down_proj_bias=m.down_proj_bias, num_experts=m.num_experts)

        def forward(hidden_states, top_k_index, top_k_weights):
            gu, dn = (m.gate_up_proj.transpose(1, 2), m.down_proj.transpose(1, 2)) if t else (m.gate_up_proj, m.down_proj)
            return layout.eager(ex, hidden_states, top_k_index, top_k_weights, gu, dn,
                                lambda x, p, e: straight_through_input(x, qs[p][e]))
        m.forward = forward
        return _Restore(m)

    def results(self, state: tuple) -> dict[str, QuantizedWeight]:
        out = {}
        for k, p in enumerate(_PROJ):
            V, alpha = state[k]
            for e, g in enumerate(self.grids[p]):
                q, latent = g.final(V[e], None if alpha is None else alpha[e])
                out[self.start.names[p][e]] = QuantizedWeight(q, latent=latent)
        return out


def _output(y):
    return y[0] if isinstance(y, (tuple, list)) else y


def _run(layer: nn.Module, inp, device, weights: Optional[dict] = None) -> torch.Tensor:
    args = (to_device(inp.hidden, device), *to_device(inp.args, device))
    kwargs = to_device(inp.kwargs, device)
    if weights is None:
        return _output(layer(*args, **kwargs))
    return _output(torch.func.functional_call(layer, weights, args, kwargs, strict=False))


def fake_weights(learners: list, states: Optional[list] = None) -> dict[str, torch.Tensor]:
    """Layer-relative parameter name -> its fake-quantized value, for every learner (its current parameters, or
    ``states``)."""
    weights = {}
    for k, ln in enumerate(learners):
        weights.update(ln.weights(states[k] if states is not None else None))
    return weights


def batch_loss(layer: nn.Module, learners: list, inp, target: torch.Tensor, device,
               states: Optional[list] = None) -> torch.Tensor:
    """mean((layer with fake-quantized weights)(inp) - target)^2) in FP32 (inputs quantized by the learners'
    hooks while ``reconstruct`` runs)."""
    y = _run(layer, inp, device, fake_weights(learners, states))
    return (y.float() - target.to(device).float()).square().mean()


@torch.no_grad()
def sign_step(learners: list, lr: float, min_clip: float) -> None:
    """One sign-SGD step on every learner's gradients: p -= lr * sign(grad) (grads cleared), then V clamped
    to [-0.5, 0.5] and alpha to [min_clip, 1]."""
    for ln in learners:
        for p in ln.parameters():
            if p.grad is not None:
                p.sub_(lr * torch.sign(p.grad))
                p.grad = None
        ln.clamp(min_clip)


@torch.no_grad()
def _total(layer, learners, inputs, targets, device, states) -> float:
    return sum(float(batch_loss(layer, learners, inp, y, device, states)) for inp, y in zip(inputs, targets)) \
        / max(len(inputs), 1)


def reconstruct(layer: nn.Module, learners: list, inputs, device, options: AutoRoundOptions) -> tuple[list, dict]:
    """Learn every learner's parameters for ``layer`` on ``inputs`` (see the module docstring). Returns the
    chosen states (one per learner) and the layer's figures: "start_mse" and "mse" (the layer's output error
    over all calibration batches at the start and for the chosen states), "learned" (whether the learned
    states were kept), "iters", "seconds"."""
    t0 = time.perf_counter()
    with torch.no_grad():
        targets = [_run(layer, inp, device).to(inp.hidden.device) for inp in inputs]
    frozen = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    hooks = [h for h in (ln.hook() for ln in learners) if h is not None]
    start = [ln.state() for ln in learners]
    try:
        best, best_states = math.inf, start
        if options.iters:
            order = torch.randint(len(inputs), (options.iters,), generator=torch.Generator().manual_seed(options.seed))
            with torch.enable_grad():
                for t in range(options.iters):
                    b = int(order[t])
                    value = batch_loss(layer, learners, inputs[b], targets[b], device)
                    if float(value.detach()) < best:  # the parameters this loss was measured with
                        best, best_states = float(value.detach()), [ln.state() for ln in learners]
                    value.backward()
                    sign_step(learners, options.step * (1.0 - t / options.iters), options.min_clip)
        start_mse = _total(layer, learners, inputs, targets, device, start)
        mse = _total(layer, learners, inputs, targets, device, best_states) if best_states is not start else start_mse
        learned = mse < start_mse
    finally:
        for h in hooks:
            h.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)
    return (best_states if learned else start), {
        "start_mse": start_mse, "mse": mse if learned else start_mse, "learned": learned, "iters": options.iters,
        "seconds": round(time.perf_counter() - t0, 3)}


__all__ = ["ExpertsLearner", "LinearLearner", "batch_loss", "fake_weights", "reconstruct", "sign_step"]
