"""Training with a recipe on transformers' fused MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``forward(hidden_states, top_k_index, top_k_weights)``).

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

import torch
import torch.nn.functional as F
from torch import nn

from ..recipes import LinearRecipe
from .linear import quantized_linear
from .moe import RoutingPlan, combine, dispatch
from .nvfp4_experts import fused_experts_layout, has_fused_expert_parameters


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

    def __init__(self, module: nn.Module, recipe: LinearRecipe | None = None, generator=None):
        super().__init__()
        why = fused_experts_layout(module)
        if why is not None:
            raise ValueError(f"{type(module).__name__}: {why}")
        if recipe is not None and not isinstance(recipe, LinearRecipe):
            raise ValueError(f"QuantizedFusedExperts recipe must be a LinearRecipe or None, got "
                             f"{type(recipe).__name__}")
        E, two_i, H = module.gate_up_proj.shape
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, two_i // 2
        self.gate_up_proj, self.down_proj = module.gate_up_proj, module.down_proj
        self.act_fn = module.act_fn
        self.recipe, self.generator = recipe, generator
        self.replaced_class = type(module).__name__
        self.__dict__["_original"] = module  # not a submodule: its Parameters are ours

    def original(self) -> nn.Module:
        """The replaced transformers module, holding this module's current Parameters."""
        m = self._original
        m.gate_up_proj, m.down_proj = self.gate_up_proj, self.down_proj
        return m

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.recipe is None:
            return F.linear(x, w)
        return quantized_linear(x, w, None, self.recipe, self.generator)

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
        if not outs:  # nothing routed: keep the weights in the graph (zero gradients, not None)
            tie = (self.gate_up_proj.sum() + self.down_proj.sum()) * 0.0
            return torch.zeros_like(hidden_states) + tie.to(hidden_states.dtype)
        y = combine(outs[0] if len(outs) == 1 else torch.cat(outs), plan, hidden_states.shape[0])
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        r = "none" if self.recipe is None else ("quantized" if self.recipe.quantized else self.recipe.unquantized_dtype)
        return (f"{self.replaced_class}: num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, recipe={r}")


def fused_experts_to_convert(module: nn.Module) -> bool:
    """Whether ``convert`` treats ``module`` as transformers fused experts (3-D gate_up_proj / down_proj)."""
    return not isinstance(module, QuantizedFusedExperts) and has_fused_expert_parameters(module)


__all__ = ["QuantizedFusedExperts", "fused_experts_to_convert", "routing_plan"]
