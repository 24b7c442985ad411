"""NVFP4GptOssExperts: the NVFP4 inference replacement of transformers' ``GptOssExperts`` (gpt-oss).

gpt-oss keeps its experts transposed, ``x @ W``: ``gate_up_proj`` [E, H, 2I] with gate / up INTERLEAVED in
the last dim (column 2j is gate j, 2j+1 up j), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H],
``down_proj_bias`` [E, H], and a clamped GLU: g = min(gate, limit), u = clamp(up, -limit, limit),
out = (u + 1) * g * sigmoid(alpha * g).

Each expert e stores the NVFP4 weights of the out x in matrices (like ``NVFP4Experts``, whose buffers and
helpers this class reuses): ``gate_up`` = gate_up_proj[e]^T [2I, H], rows kept in the checkpoint's
interleaved order (row 2j gate j, row 2j+1 up j: what vLLM's gpt-oss loaders slice, ``w13`` rows
``2*tp_start:2*tp_end``), one FP32 outer scale per expert for gate and up together (one tensor);
``down`` = down_proj[e]^T [H, I] with its own. The biases stay in high precision (the module's dtype),
buffers ``gate_up_proj_bias`` / ``down_proj_bias`` under transformers' names.

Forward: W4A16 runs ``GptOssExperts.forward`` itself on the dequantized weights transposed back
(contiguous [E, H, 2I] / [E, I, H]) and the stored biases, so the output equals that of the original
module holding those weights bit for bit. W4A4 runs the same loop with each expert's gate/up input and
down input fake-quantized to NVFP4 with the expert's calibrated input scale.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quant import QuantizedTensor
from .nvfp4_experts import NVFP4Experts, check_expert_counts, shell_of

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


class NVFP4GptOssExperts(NVFP4Experts):
    """gpt-oss experts with NVFP4 weights, one outer scale per expert and projection (gate/up shared).

    Buffers as ``NVFP4Experts`` (gate_up [E, 2I, H] rows interleaved, down [E, H, I]) plus the biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] in the module's dtype.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__(num_experts, hidden_dim, intermediate_dim, input_scale_rule=input_scale_rule,
                         input_error=input_error, dtype=dtype, device=device)
        self.register_buffer("gate_up_proj_bias", torch.zeros(num_experts, 2 * intermediate_dim, dtype=dtype,
                                                              device=device))
        self.register_buffer("down_proj_bias", torch.zeros(num_experts, hidden_dim, dtype=dtype, device=device))

    @classmethod
    def from_experts(cls, module: nn.Module, gate_up: list[QuantizedTensor], down: list[QuantizedTensor], *,
                     gate_up_input_scale: Optional[torch.Tensor] = None,
                     down_input_scale: Optional[torch.Tensor] = None, input_scale_rule: Optional[str] = None,
                     input_error: str = "mse") -> "NVFP4GptOssExperts":
        """Replace the ``GptOssExperts`` ``module``: ``gate_up[e]`` / ``down[e]`` are expert e's NVFP4
        weights of gate_up_proj[e]^T [2I, H] (interleaved rows) / down_proj[e]^T [H, I], one outer scale
        each; the biases are copied (not when ``module`` is on the meta device: loading fills them).
        W4A4: ``*_input_scale`` [E] encode scales and the rule."""
        why = gpt_oss_experts_layout(module)
        if why is not None:
            raise ValueError(f"{type(module).__name__}: {why}")
        E, H, two_i = module.gate_up_proj.shape
        check_expert_counts(E, gate_up, down, gate_up_input_scale, down_input_scale, input_scale_rule)
        device = next((q.codes.device for q in gate_up), module.gate_up_proj.device)
        m = cls(E, H, two_i // 2, input_scale_rule=input_scale_rule, input_error=input_error,
                dtype=module.gate_up_proj.dtype, device=device)
        m.fill_weights(gate_up, down, gate_up_input_scale, down_input_scale)
        if module.gate_up_proj_bias.device.type != "meta":
            m.gate_up_proj_bias.copy_(module.gate_up_proj_bias.detach())
            m.down_proj_bias.copy_(module.down_proj_bias.detach())
        m.__dict__["_hf_shell"] = shell_of(module)
        return m

    # -- forward --------------------------------------------------------------------------------
    def forward_with(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, quantize_input=None) -> torch.Tensor:
        """The forward on the given out x in weights gate_up [E, 2I, H] (interleaved rows) / down [E, H, I]:
        W4A16 ``GptOssExperts.forward`` on them transposed back; W4A4 its loop with quantized inputs
        (``quantize_input(x, proj, expert)``, default ``self.quantize_input``)."""
        shell = self._hf_shell
        if shell is None:
            raise ValueError("NVFP4GptOssExperts needs the GptOssExperts it replaces (build it with from_experts)")
        biases = (self.gate_up_proj_bias, self.down_proj_bias)
        if self.input_scale_rule is None:
            return gpt_oss_forward(shell, hidden_states, top_k_index, top_k_weights, gate_up, down, *biases)
        return eager_gpt_oss_experts(shell, hidden_states, top_k_index, top_k_weights, gate_up, down, *biases,
                                     self.num_experts, quantize_input or self.quantize_input)

    def _eager(self, hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input=None) -> torch.Tensor:
        return eager_gpt_oss_experts(self._hf_shell, hidden_states, top_k_index, top_k_weights, gate_up, down,
                                     self.gate_up_proj_bias, self.down_proj_bias, self.num_experts,
                                     quantize_input or self.quantize_input)


def gpt_oss_forward(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor,
                    down_bias: torch.Tensor) -> torch.Tensor:
    """``GptOssExperts.forward`` (``shell``: ``shell_of`` the replaced module) on the out x in weights gate_up
    [E, 2I, H] / down [E, H, I] transposed back (contiguous) and the given biases."""
    d = shell.__dict__
    d["gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
    d["down_proj"] = down.transpose(1, 2).contiguous()
    d["gate_up_proj_bias"], d["down_proj_bias"] = gate_up_bias, down_bias
    try:
        return type(shell).forward(shell, hidden_states, top_k_index, top_k_weights)
    finally:
        for k in _PARAMS:
            del d[k]


def eager_gpt_oss_experts(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          gate_up_bias: torch.Tensor, down_bias: torch.Tensor, num_experts: int,
                          quantize_input) -> torch.Tensor:
    """``GptOssExperts.forward``'s loop on the out x in weights, each expert's gate/up input and down input
    passed through ``quantize_input(x, proj, expert)``."""
    next_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        e = int(expert_idx)
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = quantize_input(hidden_states[token_idx], "gate_up", e)
        gu = current_state @ gate_up[e].transpose(0, 1) + gate_up_bias[e]
        gated = quantize_input(type(shell)._apply_gate(shell, gu), "down", e)
        out = gated @ down[e].transpose(0, 1) + down_bias[e]
        weighted = out * top_k_weights[token_idx, top_k_pos, None]
        next_states.index_add_(0, token_idx, weighted.to(hidden_states.dtype))
    return next_states


__all__ = ["GPT_OSS_EXPERTS", "NVFP4GptOssExperts", "eager_gpt_oss_experts", "gpt_oss_expert_matrices",
           "gpt_oss_experts_layout", "gpt_oss_forward", "is_gpt_oss_experts"]
