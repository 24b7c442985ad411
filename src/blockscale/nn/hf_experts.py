"""Training with a recipe on transformers' fused MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``forward(hidden_states, top_k_index, top_k_weights)``;
gpt-oss: see ``QuantizedGptOssExperts``).

``QuantizedFusedExperts`` replaces such a module and keeps its very Parameters (same objects, same names:
optimizers and ``state_dict`` keys are unchanged). Its forward lays the T*k (token, expert) assignments out
sorted by expert (a ``RoutingPlan``, within an expert in the order transformers' eager loop visits them: by
top-k rank, then token), runs one GEMM per expert and projection on a contiguous block of rows, and combines:

    x_sorted = dispatch(x, plan)                             [S, H]
    h_e      = x_e @ gate_up_proj[e]^T                        [n_e, 2I]   one GEMM: gate and up share it
    y_e      = (act(h_e[:, :I]) * h_e[:, I:]) @ down_proj[e]^T
    y[t]     = sum over t's slots of top_k_weight * y_e      (combine: FP32, cast to the input dtype)

Each GEMM is ``quantized_linear`` with the recipe (so each expert's weight slice is quantized on its own:
one NVFP4 outer scale per expert and projection, gate and up sharing theirs), or plain ``F.linear`` with
``recipe=None``. Expert index ``E`` (transformers' "no expert" sentinel) is skipped, as the eager loop does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..recipes import LinearRecipe
from .linear import quantized_linear
from .moe import RoutingPlan, combine, dispatch
from .experts_layout import has_fused_expert_parameters
from .experts_layouts import experts_layout_named, experts_layout_of


def routing_plan(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> RoutingPlan:
    """The assignments of ``top_k_index`` [T, k] sorted by expert; within an expert by top-k rank j, then token
    (transformers' eager order); ``order`` holds t*k + j; slots routed to the sentinel ``num_experts`` dropped."""
    T, k = top_k_index.shape
    flat = top_k_index.t().reshape(-1)  # index j*T + t
    jt = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    jt = jt[:int(counts[:num_experts].sum())]
    token = jt % T
    order = token * k + jt // T
    weight = top_k_weights.reshape(-1)[order]
    return RoutingPlan(order=order, token=token, weight=weight, counts=counts[:num_experts])


class QuantizedFusedExperts(nn.Module):
    """The training replacement of a fused-experts module (``fused_experts_layout`` accepts it): the same
    ``gate_up_proj`` / ``down_proj`` Parameters and ``act_fn``; GEMMs per ``recipe`` (a LinearRecipe or None).
    ``generator``: as in QuantizedLinear. ``original()``: the replaced module (holding these Parameters)."""

    #: the replaced module's Parameters this module holds (in the replaced module's order)
    PARAMETERS: tuple = ("gate_up_proj", "down_proj")
    #: the ``ExpertsLayout`` it replaces (``nn.experts_layouts``)
    LAYOUT: str = "fused"

    def __init__(self, module: nn.Module, recipe: LinearRecipe | None = None, generator=None):
        super().__init__()
        why = self.layout(module)
        if why is not None:
            raise ValueError(f"{type(module).__name__}: {why}")
        if recipe is not None and not isinstance(recipe, LinearRecipe):
            raise ValueError(f"{type(self).__name__} recipe must be a LinearRecipe or None, got "
                             f"{type(recipe).__name__}")
        for k in self.PARAMETERS:
            setattr(self, k, getattr(module, k))
        self.num_experts, self.hidden_dim, self.intermediate_dim = self.dims(module)
        self.adopt(module)
        self.recipe, self.generator = recipe, generator
        self.replaced_class = type(module).__name__
        self.__dict__["_original"] = module  # not a submodule: its Parameters are ours

    @classmethod
    def layout(cls, module: nn.Module) -> Optional[str]:
        """Why ``module`` cannot be replaced by this class, or None."""
        return experts_layout_named(cls.LAYOUT).why_not(module)

    @classmethod
    def dims(cls, module: nn.Module) -> tuple[int, int, int]:
        """(E, H, I) of the replaced module."""
        return experts_layout_named(cls.LAYOUT).dims(module)

    def adopt(self, module: nn.Module) -> None:
        """Take the replaced module's non-Parameter parts (here its ``act_fn``)."""
        self.act_fn = module.act_fn

    def original(self) -> nn.Module:
        """The replaced transformers module, holding this module's current Parameters."""
        m = self._original
        for k in self.PARAMETERS:
            setattr(m, k, getattr(self, k))
        return m

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.recipe is None:
            return F.linear(x, w)
        return quantized_linear(x, w, None, self.recipe, self.generator)

    def _no_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Nothing routed: zeros, the weights kept in the graph (zero gradients, not None)."""
        tie = sum(getattr(self, k).sum() for k in self.PARAMETERS) * 0.0
        return torch.zeros_like(hidden_states) + tie.to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        plan = routing_plan(top_k_index, top_k_weights, self.num_experts)
        x_sorted = dispatch(hidden_states, plan)
        # unbind: one backward op stacks the per-expert grads (zeros for experts without rows)
        gu, dn = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outs, start = [], 0
        for e, n in enumerate(plan.counts.tolist()):
            if n == 0:
                continue
            gate, up = self._linear(x_sorted[start:start + n], gu[e]).chunk(2, dim=-1)
            start += n
            outs.append(self._linear(self.act_fn(gate) * up, dn[e]))
        if not outs:
            return self._no_rows(hidden_states)
        y = combine(outs[0] if len(outs) == 1 else torch.cat(outs), plan, hidden_states.shape[0])
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        r = "none" if self.recipe is None else ("quantized" if self.recipe.quantized else self.recipe.unquantized_dtype)
        return (f"{self.replaced_class}: num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, recipe={r}")


class QuantizedGptOssExperts(QuantizedFusedExperts):
    """The training replacement of transformers' ``GptOssExperts`` (``gpt_oss_experts_layout`` accepts it):
    gate_up_proj [E, H, 2I] (transposed, ``x @ W``; column 2j gate j, 2j+1 up j), gate_up_proj_bias [E, 2I],
    down_proj [E, I, H], down_proj_bias [E, H], the same four Parameters. Per expert e, on its rows x_e
    (laid out as in ``QuantizedFusedExperts``):

        h_e = linear(x_e, gate_up_proj[e]^T) + gate_up_proj_bias[e]        [n_e, 2I]   weight [2I, H]: blocks along H
        y_e = linear(_apply_gate(h_e), down_proj[e]^T) + down_proj_bias[e]  [n_e, H]    weight [H, I]: blocks along I
        y   = zeros.index_add(tokens, (y_e * top_k_weight).to(x.dtype))    (GptOssExperts' combine)

    ``linear`` is ``quantized_linear`` with the recipe (output in x's dtype), or ``F.linear`` with None; the
    weights are transposed views of the Parameters (gradients reach them), quantized as the out x in
    matrices NVFP4GptOssExperts stores; the biases are added after the GEMM, in high precision (never
    quantized). ``_apply_gate`` (the clamped GLU: alpha, limit) is the replaced module's own."""

    PARAMETERS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    LAYOUT = "gpt-oss"

    def adopt(self, module: nn.Module) -> None:
        pass  # _apply_gate (and its alpha / limit) are read from the replaced module

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        plan = routing_plan(router_indices, routing_weights, self.num_experts)
        x_sorted = dispatch(hidden_states, plan)
        gu, gb = self.gate_up_proj.unbind(0), self.gate_up_proj_bias.unbind(0)
        dn, db = self.down_proj.unbind(0), self.down_proj_bias.unbind(0)
        gate = self._original._apply_gate
        outs, start = [], 0
        for e, n in enumerate(plan.counts.tolist()):
            if n == 0:
                continue
            h = self._linear(x_sorted[start:start + n], gu[e].t()) + gb[e]
            start += n
            outs.append(self._linear(gate(h), dn[e].t()) + db[e])
        if not outs:
            return self._no_rows(hidden_states)
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        weighted = (y * plan.weight[:, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, plan.token, weighted)


#: the training class of each experts layout
TRAINING_EXPERTS = {cls.LAYOUT: cls for cls in (QuantizedFusedExperts, QuantizedGptOssExperts)}


def _training_class(module: nn.Module) -> type:
    lay = experts_layout_of(module)
    return TRAINING_EXPERTS.get(lay.name if lay is not None else "fused", QuantizedFusedExperts)


def convertible_experts_layout(module: nn.Module) -> Optional[str]:
    """Why ``convert`` cannot replace the fused-experts ``module`` (by the training class of its layout:
    ``QuantizedFusedExperts``, or ``QuantizedGptOssExperts`` for ``GptOssExperts``), or None."""
    return _training_class(module).layout(module)


def quantized_experts(module: nn.Module, recipe: LinearRecipe | None = None, generator=None) -> QuantizedFusedExperts:
    """The training replacement of the fused-experts ``module`` (``convertible_experts_layout`` accepts it)."""
    return _training_class(module)(module, recipe, generator)


def fused_experts_to_convert(module: nn.Module) -> bool:
    """Whether ``convert`` treats ``module`` as transformers fused experts (3-D gate_up_proj / down_proj)."""
    return not isinstance(module, QuantizedFusedExperts) and has_fused_expert_parameters(module)


__all__ = ["QuantizedFusedExperts", "QuantizedGptOssExperts", "convertible_experts_layout", "fused_experts_to_convert",
           "quantized_experts", "routing_plan"]
