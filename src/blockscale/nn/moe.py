"""Mixture of Experts: a top-k softmax router over E SwiGLU experts, in three separate stages.

For the T = B*L tokens x_t of a batch:

    p_t    = softmax(W_r x_t)                        router probabilities over E experts (FP32)
    S_t    = top-k(p_t)                              the k experts of token t
    g_te   = p_te / sum_{e' in S_t} p_te'            (or p_te when normalize_top_k is False)
    y_t    = sum_{e in S_t} g_te * E_e(x_t)  [+ E_shared(x_t)]
    E_e(x) = w2[e] (silu(w1[e] x) * w3[e] x)         SwiGLU, weights [out, in] per expert

The T*k (token, expert) assignments are laid out sorted by expert (a ``RoutingPlan``), so the
expert stage is one grouped GEMM per expert over a contiguous block of rows:

    plan, aux = router(x2d)                          route
    x_sorted  = dispatch(x2d, plan)                  x2d[plan.token]           [T*k, d]
    y_sorted  = experts(x_sorted, plan.counts)       one loop over experts, never over tokens
    y         = combine(y_sorted, plan, T)           index_add of weight * y_sorted (FP32)

Expert parallelism replaces ``dispatch`` / ``combine`` by all-to-alls and gives each rank a
``GroupedExperts`` holding its slice of the experts (``first_expert``, ``n_local``).

Load balancing (Switch Transformer), added to the training loss:

    aux = coef * E * sum_e f_e * P_e
    f_e = (assignments routed to e) / (T*k)          not differentiable (a count)
    P_e = mean_t p_te                                differentiable: the router learns through it

A perfectly balanced router (f_e = P_e = 1/E) gives aux = coef; one that sends every token to the
same k experts with probability 1/k each gives coef * E / k.

Quantization: with a ``LinearRecipe`` each expert's three GEMMs run through ``quantized_linear``
with that expert's own weight slice w[e], so every NVFP4 outer (per-tensor) scale is per expert:
an outlier in one expert does not crush the others' block scales. That is the same as quantizing
the stacked [E, N, K] weight with ``NVFP4(outer="group")`` (one outer scale per slice of dim 0):
the codes, block scales and outer scales of slice e equal those of ``quantize(w[e], NVFP4())``
(for ``block_2d`` too: the 16x16 tiles never cross experts). The router is never quantized (it
is not an ``nn.Linear``, so ``convert`` cannot swap it, and its logits are computed in FP32 even
under autocast: a bf16 rounding can flip a top-k choice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..recipes import LinearRecipe
from .linear import QuantizedLinear, quantized_linear


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"MoEConfig.{name}={value!r}: expected an int >= {low}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and training rules of an MoE block.

    d_ff: expert hidden size; 0 takes the model's FFN hidden size.
    shared_expert: one always-on SwiGLU expert (hidden size d_ff) added to the routed output.
    aux_loss_coef: coefficient of the load-balancing loss (0 disables its gradient).
    normalize_top_k: renormalise the k chosen probabilities to sum to 1. With top_k=1 the weight is
      then always 1 and the router learns only from the aux loss (Switch uses False for top-1).
    """

    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 0
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    normalize_top_k: bool = True

    def __post_init__(self):
        _check_int("n_experts", self.n_experts, 1)
        _check_int("top_k", self.top_k, 1)
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k}: expected 1 <= top_k <= n_experts={self.n_experts}")
        _check_int("d_ff", self.d_ff, 0)
        for name in ("shared_expert", "normalize_top_k"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r}: expected True or False")
        c = self.aux_loss_coef
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef={c!r}: expected a finite float >= 0")


@dataclass
class RoutingPlan:
    """The T*k (token, expert) assignments sorted by expert (stable: token order within an expert).

    order:  [T*k] long     assignment index t*k + j of each sorted slot (j: rank in token t's top-k)
    token:  [T*k] long     the token of each sorted slot (= order // k)
    weight: [T*k] float32  the router weight g_te of each sorted slot (differentiable)
    counts: [E] long       slots per expert, in expert order (sum = T*k)
    """

    order: Tensor
    token: Tensor
    weight: Tensor
    counts: Tensor


class Router(nn.Module):
    """Top-k softmax router: ``forward(x2d [T, d]) -> (RoutingPlan, aux_loss)``.

    Holds a [E, d] weight used like ``nn.Linear(d, E, bias=False)``, but is not an nn.Linear on
    purpose: model conversion never quantizes it, and the logits are FP32 whatever the autocast.
    """

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.normalize_top_k, self.aux_loss_coef = cfg.normalize_top_k, float(cfg.aux_loss_coef)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, d_model))
        nn.init.uniform_(self.weight, -1 / math.sqrt(d_model), 1 / math.sqrt(d_model))  # nn.Linear's default

    def probs(self, x2d: Tensor) -> Tensor:
        """p = softmax(W_r x) in FP32: [T, E]."""
        with torch.autocast(x2d.device.type, enabled=False):
            logits = F.linear(x2d.float(), self.weight.float())
        return logits.softmax(dim=-1)

    def route(self, x2d: Tensor) -> tuple[RoutingPlan, Tensor]:
        """(RoutingPlan, p [T, E] FP32): the routing without the load-balancing loss (``forward`` adds
        it on these tokens; expert parallelism can form it over every rank's tokens instead)."""
        E, k = self.n_experts, self.top_k
        p = self.probs(x2d)
        top_p, top_e = p.topk(k, dim=-1)  # [T, k], largest first
        w = top_p / top_p.sum(dim=-1, keepdim=True) if self.normalize_top_k else top_p
        flat_e = top_e.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E)
        return RoutingPlan(order=order, token=order // k, weight=w.reshape(-1)[order], counts=counts), p

    def forward(self, x2d: Tensor) -> tuple[RoutingPlan, Tensor]:
        T, E, k = x2d.shape[0], self.n_experts, self.top_k
        plan, p = self.route(x2d)
        if T == 0:  # no tokens: nothing to balance (and mean over no tokens would be NaN)
            return plan, self.weight.sum() * 0.0
        f = plan.counts.to(torch.float32) / (T * k)
        aux = self.aux_loss_coef * E * (f * p.mean(dim=0)).sum()
        return plan, aux

    def extra_repr(self) -> str:
        return (f"d_model={self.weight.shape[1]}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"normalize_top_k={self.normalize_top_k}, aux_loss_coef={self.aux_loss_coef}")


def dispatch(x2d: Tensor, plan: RoutingPlan) -> Tensor:
    """The rows the experts read, grouped by expert: x2d[plan.token] -> [T*k, d]."""
    return x2d[plan.token]


def combine(y_sorted: Tensor, plan: RoutingPlan, n_tokens: int) -> Tensor:
    """out[t] = sum over t's slots of weight * y_sorted, accumulated in FP32 -> [n_tokens, d] FP32.

    (On CUDA, index_add sums a row's k contributions in an unspecified order: bit-reproducible only
    for k <= 2, where the two additions onto 0 commute.)
    """
    out = y_sorted.new_zeros((n_tokens, y_sorted.shape[-1]), dtype=torch.float32)
    return out.index_add(0, plan.token, plan.weight.unsqueeze(-1) * y_sorted.float())


class GroupedExperts(nn.Module):
    """SwiGLU experts ``first_expert .. first_expert + n_local - 1`` of ``n_experts``, weights stacked:
    w1, w3 [n_local, d_ff, d], w2 [n_local, d, d_ff] (each slice in nn.Linear's [out, in] layout).

    ``forward(x_sorted [S, d], counts [n_local] long) -> [S, d]``: rows of x_sorted come grouped by
    local expert, counts[e] rows for expert e, in order; each group gets w2(silu(w1 x) * w3 x). One
    loop over experts (empty groups skipped); an expert with no rows gets a zero gradient.

    recipe: a LinearRecipe -> each GEMM is ``quantized_linear`` with the expert's own weight slice
    (per-expert NVFP4 outer scales); None -> plain F.linear. ``generator``: as in QuantizedLinear.
    """

    def __init__(self, n_experts: int, d: int, d_ff: int, recipe: LinearRecipe | None = None,
                 first_expert: int = 0, n_local: int | None = None, generator=None):
        super().__init__()
        n_local = n_experts - first_expert if n_local is None else n_local
        for name, value, low in (("n_experts", n_experts, 1), ("d", d, 1), ("d_ff", d_ff, 1),
                                 ("first_expert", first_expert, 0), ("n_local", n_local, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GroupedExperts {name}={value!r}: expected an int >= {low}")
        if first_expert + n_local > n_experts:
            raise ValueError(f"GroupedExperts: experts {first_expert}..{first_expert + n_local - 1} "
                             f"exceed n_experts={n_experts}")
        if recipe is not None and not isinstance(recipe, LinearRecipe):
            raise ValueError(f"GroupedExperts recipe must be a LinearRecipe or None, got {type(recipe).__name__}")
        self.n_experts, self.first_expert, self.n_local = n_experts, first_expert, n_local
        self.d, self.d_ff = d, d_ff
        self.recipe, self.generator = recipe, generator
        self.w1 = nn.Parameter(torch.empty(n_local, d_ff, d))
        self.w3 = nn.Parameter(torch.empty(n_local, d_ff, d))
        self.w2 = nn.Parameter(torch.empty(n_local, d, d_ff))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) per slice."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1 / math.sqrt(w.shape[-1])
            w.uniform_(-bound, bound)

    def _linear(self, x: Tensor, w: Tensor) -> Tensor:
        if self.recipe is None:
            return F.linear(x, w)
        return quantized_linear(x, w, None, self.recipe, self.generator)

    def forward(self, x_sorted: Tensor, counts: Tensor) -> Tensor:
        if counts.shape != (self.n_local,):
            raise ValueError(f"counts has shape {tuple(counts.shape)}; expected ({self.n_local},): "
                             "one per local expert")
        sizes = counts.tolist()  # one host sync per call: group boundaries are Python ints
        if sum(sizes) != x_sorted.shape[0] or min(sizes) < 0:
            raise ValueError(f"counts {sizes} do not partition the {x_sorted.shape[0]} rows of x_sorted")
        # unbind: one backward op stacks the per-expert grads (zeros for skipped experts) instead
        # of E full-size scatters, one per indexed slice
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        outs, start = [], 0
        for e, n in enumerate(sizes):
            if n == 0:
                continue
            xe = x_sorted[start:start + n]
            start += n
            h = F.silu(self._linear(xe, w1[e])) * self._linear(xe, w3[e])
            outs.append(self._linear(h, w2[e]))
        if not outs:  # no rows at all (e.g. an expert-parallel rank nobody routed to): keep the
            # weights in the graph so they get zero gradients, not None (DDP needs every grad)
            tie = (self.w1.sum() + self.w3.sum() + self.w2.sum()) * 0.0
            return x_sorted.new_zeros((0, self.d)) + tie.to(x_sorted.dtype)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def extra_repr(self) -> str:
        r = "none" if self.recipe is None else ("quantized" if self.recipe.quantized else self.recipe.unquantized_dtype)
        return (f"n_experts={self.n_experts}, first_expert={self.first_expert}, n_local={self.n_local}, "
                f"d={self.d}, d_ff={self.d_ff}, recipe={r}")


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN w2(silu(w1 x) * w3 x) of nn.Linear layers (QuantizedLinear given a recipe)."""

    def __init__(self, d: int, d_ff: int, recipe: LinearRecipe | None = None):
        super().__init__()

        def lin(i, o):
            return nn.Linear(i, o, bias=False) if recipe is None else QuantizedLinear(i, o, bias=False, recipe=recipe)

        self.w1, self.w2, self.w3 = lin(d, d_ff), lin(d_ff, d), lin(d, d_ff)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """``forward(x [B, L, d]) -> [B, L, d]`` = combine(experts(dispatch(x))) [+ shared_expert(x)].

    After each forward ``self.aux_loss`` holds the load-balancing loss (scalar, differentiable;
    see the module docstring); the model adds it to its training loss.
    Submodules: ``router`` (Router), ``experts`` (GroupedExperts), ``shared_expert`` (SwiGLU or None).
    """

    def __init__(self, d_model: int, d_ff: int, cfg: MoEConfig, recipe: LinearRecipe | None = None):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        hidden = cfg.d_ff or d_ff
        self.router = Router(d_model, cfg)
        self.experts = GroupedExperts(cfg.n_experts, d_model, hidden, recipe)
        self.shared_expert = SwiGLU(d_model, hidden, recipe) if cfg.shared_expert else None
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        plan, self.aux_loss = self.router(x2d)
        y = self.experts(dispatch(x2d, plan), plan.counts)
        out = combine(y, plan, x2d.shape[0])
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2d).float()
        return out.to(x.dtype).view(shape)

    def __getstate__(self):
        # aux_loss is tied to the last forward's graph: such a tensor cannot be deep-copied or
        # pickled, and a copy of the module has no use for it
        state = nn.Module.__getstate__(self).copy()  # explicit: ExpertParallelMoE reuses this method
        state["aux_loss"] = None
        return state


__all__ = ["GroupedExperts", "MoE", "MoEConfig", "Router", "RoutingPlan", "SwiGLU", "combine", "dispatch"]
