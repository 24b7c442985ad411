"""NVFP4Experts: the NVFP4 name and constructor of ``QuantizedExperts`` for the standard fused layout (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 routed experts: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]).

Each expert e has its own NVFP4 weights: the gate/up rows [2I, H] share one FP32 outer encode scale
(serving engines load gate and up of one expert as one GEMM), the down rows [H, I] have their own.
W4A4 adds one calibrated input encode scale per expert and projection (gate/up input, down input).
Storage, forward and the rest: ``QuantizedExperts`` (W4A16 runs the replaced class's own forward on the
dequantized weights; W4A4 the eager routing loop with each expert's inputs fake-quantized to NVFP4 with its
calibrated outer scale).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quant import NVFP4, QuantizedTensor
from ..quant.nvfp4 import INPUT_SCALE_RULES
from .quantized_experts import PROJECTIONS, QuantizedExperts


def check_expert_counts(E: int, gate_up: list, down: list, gate_up_input_scale, down_input_scale,
                        input_scale_rule) -> None:
    """ValueError unless there are E quantized experts per projection and, for W4A4 (``input_scale_rule``
    set), both input scales (none of them for W4A16)."""
    if len(gate_up) != E or len(down) != E:
        raise ValueError(f"expected {E} quantized experts per projection, got {len(gate_up)} and {len(down)}")
    if (gate_up_input_scale is None) != (input_scale_rule is None) or \
            (down_input_scale is None) != (input_scale_rule is None):
        raise ValueError("W4A4 needs both input scales and input_scale_rule (or none of them for W4A16)")


def _stored(input_scale_rule: Optional[str]) -> tuple:
    if input_scale_rule is not None and input_scale_rule not in INPUT_SCALE_RULES:
        raise ValueError(f"input_scale_rule={input_scale_rule!r}; allowed values: None (W4A16), "
                         f"{', '.join(map(repr, INPUT_SCALE_RULES))}")
    return ("nvfp4", "nvfp4", None if input_scale_rule is None else "nvfp4")


class NVFP4Experts(QuantizedExperts):
    """Fused MoE experts with NVFP4 weights, one outer scale per expert and projection.

    Buffers (P = gate_up [2I rows, H inputs] or down [H rows, I inputs]): ``{P}_weight_packed`` uint8
    [E, rows, inputs/2], ``{P}_weight_scale`` float8_e4m3fn [E, rows, inputs/16], ``{P}_weight_global_scale``
    FP32 [E] (S_e: x^ = q * s * (1/S_e)); W4A4: ``{P}_input_global_scale`` FP32 [E].
    H and I must be multiples of 16.
    """

    experts_kinds = ("nvfp4",)
    experts_layouts = ("fused",)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *, act_fn=None,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        if hidden_dim % 16 or intermediate_dim % 16:
            raise ValueError(f"hidden_dim={hidden_dim}, intermediate_dim={intermediate_dim}: NVFP4 experts need "
                             "multiples of 16 (one E4M3 scale per 16 inputs)")
        super().__init__(num_experts, hidden_dim, intermediate_dim, _stored(input_scale_rule),
                         rules={"input_scale_rule": input_scale_rule, "input_error": input_error},
                         layout=self.experts_layouts[0], act_fn=act_fn, dtype=dtype, device=device)

    @classmethod
    def from_experts(cls, module: nn.Module, gate_up: list[QuantizedTensor], down: list[QuantizedTensor], *,
                     gate_up_input_scale: Optional[torch.Tensor] = None,
                     down_input_scale: Optional[torch.Tensor] = None, input_scale_rule: Optional[str] = None,
                     input_error: str = "mse") -> "NVFP4Experts":
        """Replace the experts ``module`` (this class's layout: fused for NVFP4Experts, gpt-oss for
        NVFP4GptOssExperts): ``gate_up[e]`` / ``down[e]`` are expert e's NVFP4 weights [2I, H] / [H, I] in the
        layout's row order, each with one outer scale (gate and up share theirs since they are one tensor).
        W4A4: ``*_input_scale`` [E] encode scales and the rule."""
        device = next((q.codes.device for q in gate_up), module.gate_up_proj.device)
        m = cls.replacing(module, _stored(input_scale_rule),
                          {"input_scale_rule": input_scale_rule, "input_error": input_error}, device=device)
        check_expert_counts(m.num_experts, gate_up, down, gate_up_input_scale, down_input_scale, input_scale_rule)
        m.fill_weights(gate_up, down, gate_up_input_scale, down_input_scale)
        return m.adopt(module)

    @torch.no_grad()
    def fill_weights(self, gate_up: list[QuantizedTensor], down: list[QuantizedTensor],
                     gate_up_input_scale: Optional[torch.Tensor] = None,
                     down_input_scale: Optional[torch.Tensor] = None) -> None:
        """Copy expert e's NVFP4 weights ``gate_up[e]`` / ``down[e]`` (one outer scale each, shaped like
        this module's rows x inputs) and, W4A4, the [E] input encode scales into the buffers."""
        for p, qs in zip(PROJECTIONS, (gate_up, down)):
            want = self._shape(p)
            for e, q in enumerate(qs):
                if not isinstance(q.spec, NVFP4) or tuple(q.shape) != want:
                    raise ValueError(f"{p} expert {e}: expected an NVFP4 QuantizedTensor of shape {want}, got {q!r}")
                if q.outer_scale.numel() != 1:
                    raise ValueError(f"{p} expert {e}: one outer scale per expert expected")
                self._expert_view(p, e).load_quantized(q)
        if self.input_scale_rule is not None:
            self.gate_up_input_global_scale.copy_(gate_up_input_scale.reshape(self.num_experts))
            self.down_input_global_scale.copy_(down_input_scale.reshape(self.num_experts))


__all__ = ["NVFP4Experts", "check_expert_counts"]
