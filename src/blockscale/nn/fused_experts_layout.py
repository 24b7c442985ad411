"""The standard fused-experts layout of transformers >= 5 (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 routed
experts): parameters ``gate_up_proj`` [E, 2I, H] (gate rows then up rows) and ``down_proj`` [E, H, I], an
``act_fn``, ``forward(hidden_states, top_k_index, top_k_weights)``: ``FUSED_LAYOUT`` (an ``ExpertsLayout``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .experts_layout import ExpertsLayout, has_fused_expert_parameters, routed_experts, run_shell

#: the fused-experts classes of transformers >= 5 known to have this layout (checked anyway)
KNOWN_FUSED_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts",
                       "DeepseekV3Experts")
#: fused-experts classes that are not this layout, with the reason (``fused_experts_layout``). gpt-oss has
#: its own layout (``nn.gpt_oss_experts_layout``).
UNSUPPORTED_FUSED_EXPERTS = {
    "GptOssExperts": ("gpt-oss experts (gate_up_proj [E, H, 2I] transposed with gate / up columns interleaved, "
                      "gate_up_proj_bias / down_proj_bias, a clamped GLU) are not the standard fused layout; they have "
                      "their own (blockscale.nn.gpt_oss_experts_layout; convert: QuantizedGptOssExperts, "
                      "blockscale.nn.hf_experts)"),
}
_FUSED_PARAMS = ("gate_up_proj", "down_proj")


def fused_experts_layout(module: nn.Module) -> Optional[str]:
    """Why ``module`` (fused 3-D expert parameters) is not the standard fused layout, or None when it is:
    exactly the parameters gate_up_proj [E, 2I, H] and down_proj [E, H, I] (concatenated gate;up rows,
    not transposed, no biases), no buffers, an ``act_fn`` and ``num_experts`` = E."""
    if type(module).__name__ in UNSUPPORTED_FUSED_EXPERTS:
        return UNSUPPORTED_FUSED_EXPERTS[type(module).__name__]
    params = {k: p for k, p in module._parameters.items() if p is not None}
    if set(params) != set(_FUSED_PARAMS):
        return f"parameters {sorted(params)}; the supported layout has exactly gate_up_proj and down_proj"
    gu, dn = params["gate_up_proj"], params["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3:
        return f"gate_up_proj {tuple(gu.shape)}, down_proj {tuple(dn.shape)}: expected 3-D tensors"
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(dn.shape) != (E, H, two_i // 2):
        return (f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)}: expected [E, 2I, H] and "
                "[E, H, I]")
    if any(b is not None for b in module._buffers.values()):
        return f"buffers {sorted(module._buffers)}; the supported layout has none"
    flags = dict(is_transposed=False, is_concatenated=True, has_bias=False, has_gate=True, has_post_expert_norm=False)
    bad = [k for k, v in flags.items() if getattr(module, k, v) != v]
    if bad:
        return f"{', '.join(f'{k}={getattr(module, k)!r}' for k in bad)}; the supported layout has {flags}"
    if getattr(module, "num_experts", E) != E or not callable(getattr(module, "act_fn", None)):
        return "expected num_experts == gate_up_proj.shape[0] and an act_fn"
    return None


def hf_experts_forward(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The replaced class's own forward (``shell``: ``shell_of`` it) run on the weights gate_up [E, 2I, H] /
    down [E, H, I]."""
    return run_shell(shell, {"gate_up_proj": gate_up, "down_proj": down}, hidden_states, top_k_index, top_k_weights)


def eager_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, act_fn, num_experts: int, quantize_input) -> torch.Tensor:
    """The transformers eager routing loop (MixtralExperts.forward) on gate_up [E, 2I, H] / down [E, H, I],
    each expert's gate/up input and down input passed through ``quantize_input(x, proj, expert)``."""
    final_hidden_states = torch.zeros_like(hidden_states)
    for e, top_k_pos, token_idx in routed_experts(top_k_index, num_experts + 1, num_experts):
        current_state = quantize_input(hidden_states[token_idx], "gate_up", e)
        gate, up = nn.functional.linear(current_state, gate_up[e]).chunk(2, dim=-1)
        current_hidden_states = quantize_input(act_fn(gate) * up, "down", e)
        current_hidden_states = nn.functional.linear(current_hidden_states, down[e])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def _dims(m: nn.Module) -> tuple[int, int, int]:
    E, two_i, H = m.gate_up_proj.shape
    return E, H, two_i // 2


def _down_input(m: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
    return m.act_fn(gate) * up


FUSED_LAYOUT = ExpertsLayout(
    name="fused",
    claims=has_fused_expert_parameters,
    why_not=fused_experts_layout,
    dims=_dims,
    matrices=lambda m: (m.gate_up_proj.detach(), m.down_proj.detach()),
    down_input=_down_input,
    forward=lambda ex, h, i, w, gu, dn: hf_experts_forward(ex._hf_shell, h, i, w, gu, dn),
    eager=lambda ex, h, i, w, gu, dn, qi: eager_experts(h, i, w, gu, dn, ex.act_fn, ex.num_experts, qi),
)

__all__ = ["FUSED_LAYOUT", "KNOWN_FUSED_EXPERTS", "UNSUPPORTED_FUSED_EXPERTS", "eager_experts", "fused_experts_layout",
           "hf_experts_forward"]
