"""The gpt-oss experts layout (transformers' ``GptOssExperts``): ``GPT_OSS_LAYOUT`` (an ``ExpertsLayout``).

gpt-oss keeps its experts transposed, ``x @ W``: ``gate_up_proj`` [E, H, 2I] with gate / up INTERLEAVED in
the last dim (column 2j is gate j, 2j+1 up j), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H],
``down_proj_bias`` [E, H], and a clamped GLU: g = min(gate, limit), u = clamp(up, -limit, limit),
out = (u + 1) * g * sigmoid(alpha * g).

Its out x in matrices are ``gate_up`` = gate_up_proj[e]^T [2I, H], rows kept in the checkpoint's interleaved
order (row 2j gate j, row 2j+1 up j: what vLLM's gpt-oss loaders slice, ``w13`` rows ``2*tp_start:2*tp_end``),
and ``down`` = down_proj[e]^T [H, I]. The biases stay in high precision (the module's dtype) under
transformers' names. The weights-only forward runs ``GptOssExperts.forward`` itself on the weights transposed
back (contiguous [E, H, 2I] / [E, I, H]) and the stored biases, so the output equals that of the original
module holding those weights bit for bit; with quantized inputs, the same loop with each expert's gate/up
input and down input quantized.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .experts_layout import ExpertsLayout, routed_experts, run_shell

GPT_OSS_EXPERTS = "GptOssExperts"
_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def gpt_oss_experts_layout(module: nn.Module) -> Optional[str]:
    """None when ``module`` is a transformers ``GptOssExperts`` with the layout above (parameters
    gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H], no
    buffers, ``alpha`` / ``limit`` / ``_apply_gate``); why not otherwise."""
    if type(module).__name__ != GPT_OSS_EXPERTS:
        return f"{type(module).__name__} is not {GPT_OSS_EXPERTS}"
    params = {k: p for k, p in module._parameters.items() if p is not None}
    if set(params) != set(_PARAMS):
        return f"parameters {sorted(params)}; expected {list(_PARAMS)}"
    gu, gb, dn, db = (params[k] for k in _PARAMS)
    if gu.dim() != 3 or gu.shape[2] % 2:
        return f"gate_up_proj {tuple(gu.shape)}: expected [E, H, 2I]"
    E, H, two_i = gu.shape
    want = {"gate_up_proj_bias": (E, two_i), "down_proj": (E, two_i // 2, H), "down_proj_bias": (E, H)}
    bad = [f"{k} {tuple(params[k].shape)} (expected {v})" for k, v in want.items() if tuple(params[k].shape) != v]
    if bad:
        return "; ".join(bad)
    if any(b is not None for b in module._buffers.values()):
        return f"buffers {sorted(module._buffers)}; expected none"
    if getattr(module, "num_experts", E) != E or not callable(getattr(module, "_apply_gate", None)):
        return "expected num_experts == gate_up_proj.shape[0] and an _apply_gate"
    return None


def is_gpt_oss_experts(module: nn.Module) -> bool:
    """True when ``module`` is a ``GptOssExperts`` of the supported layout."""
    return type(module).__name__ == GPT_OSS_EXPERTS and gpt_oss_experts_layout(module) is None


def gpt_oss_expert_matrices(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]): the out x in matrices of a ``GptOssExperts`` (detached,
    contiguous; gate_up rows interleaved as gate_up_proj's columns)."""
    return (module.gate_up_proj.detach().transpose(1, 2).contiguous(),
            module.down_proj.detach().transpose(1, 2).contiguous())


def gpt_oss_forward(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor,
                    down_bias: torch.Tensor) -> torch.Tensor:
    """``GptOssExperts.forward`` (``shell``: ``shell_of`` the replaced module) on the out x in weights gate_up
    [E, 2I, H] / down [E, H, I] transposed back (contiguous) and the given biases."""
    tensors = {"gate_up_proj": gate_up.transpose(1, 2).contiguous(), "down_proj": down.transpose(1, 2).contiguous(),
               "gate_up_proj_bias": gate_up_bias, "down_proj_bias": down_bias}
    return run_shell(shell, tensors, hidden_states, top_k_index, top_k_weights)


def eager_gpt_oss_experts(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          gate_up_bias: torch.Tensor, down_bias: torch.Tensor, num_experts: int,
                          quantize_input) -> torch.Tensor:
    """``GptOssExperts.forward``'s loop on the out x in weights, each expert's gate/up input and down input
    passed through ``quantize_input(x, proj, expert)``."""
    if shell is None:
        raise ValueError("gpt-oss quantized experts need the GptOssExperts they replace (its clamped GLU); build "
                         "them with from_linears / from_experts")
    next_states = torch.zeros_like(hidden_states)
    for e, top_k_pos, token_idx in routed_experts(top_k_index, num_experts, num_experts):
        current_state = quantize_input(hidden_states[token_idx], "gate_up", e)
        gu = current_state @ gate_up[e].transpose(0, 1) + gate_up_bias[e]
        gated = quantize_input(type(shell)._apply_gate(shell, gu), "down", e)
        out = gated @ down[e].transpose(0, 1) + down_bias[e]
        weighted = out * top_k_weights[token_idx, top_k_pos, None]
        next_states.index_add_(0, token_idx, weighted.to(hidden_states.dtype))
    return next_states


def _dims(m: nn.Module) -> tuple[int, int, int]:
    E, H, two_i = m.gate_up_proj.shape
    return E, H, two_i // 2


GPT_OSS_LAYOUT = ExpertsLayout(
    name="gpt-oss",
    claims=lambda m: type(m).__name__ == GPT_OSS_EXPERTS,
    why_not=gpt_oss_experts_layout,
    dims=_dims,
    matrices=gpt_oss_expert_matrices,
    down_input=lambda m, e, x: m._apply_gate(x @ m.gate_up_proj[e] + m.gate_up_proj_bias[e]),
    forward=lambda ex, h, i, w, gu, dn: gpt_oss_forward(ex._hf_shell, h, i, w, gu, dn, ex.gate_up_proj_bias,
                                                        ex.down_proj_bias),
    eager=lambda ex, h, i, w, gu, dn, qi: eager_gpt_oss_experts(ex._hf_shell, h, i, w, gu, dn, ex.gate_up_proj_bias,
                                                                ex.down_proj_bias, ex.num_experts, qi),
    biases={"gate_up": "gate_up_proj_bias", "down": "down_proj_bias"},
    interleaved=True,
)

__all__ = ["GPT_OSS_EXPERTS", "GPT_OSS_LAYOUT", "eager_gpt_oss_experts", "gpt_oss_expert_matrices",
           "gpt_oss_experts_layout", "gpt_oss_forward", "is_gpt_oss_experts"]
