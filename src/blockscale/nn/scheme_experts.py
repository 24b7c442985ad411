"""SchemeExperts: the FP8 / MX name and constructor of ``QuantizedExperts`` (either layout: transformers' fused
gate_up_proj [E, 2I, H] / down_proj [E, H, I], or gpt-oss's transposed one, stored as its out x in matrices).

Each expert e and projection holds exactly what an ``FP8Linear`` / ``MXLinear`` of that matrix holds, stacked
over experts (see ``QuantizedExperts``); weights only runs the replaced class's forward on the dequantized
weights, quantized activations the layout's routing loop with each expert's inputs quantized as that expert's
Linear quantizes them (static FP8 with the expert's calibrated input scale, dynamic per-token / 1x128 FP8,
dynamic per-32 MX).
"""
from __future__ import annotations

from typing import Optional

import torch

from .quantized_experts import QuantizedExperts

SCHEME_EXPERT_KINDS = ("fp8", "mx")


class SchemeExperts(QuantizedExperts):
    """Fused MoE experts with FP8 or MX weights, one scheme for every expert.

    kind "fp8": ``weights`` = FP8 weight granularity ("tensor", "channel", "block"), ``inputs`` = None /
    "tensor" (static) / "token" / "block"; kind "mx": ``weights`` = element ("e4m3", "e2m1"), ``inputs`` =
    None or that element, ``scale_rule`` the activations' MX scale rule. ``gpt_oss``: the experts replace a
    transformers ``GptOssExperts`` (biases, clamped GLU, gate/up rows interleaved).
    """

    experts_kinds = SCHEME_EXPERT_KINDS
    experts_layouts = ("fused", "gpt-oss")

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, kind: str, weights: str,
                 inputs: Optional[str] = None, *, scale_rule: str = "ceil", act_fn=None, gpt_oss: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        if kind not in SCHEME_EXPERT_KINDS:
            raise ValueError(f"kind={kind!r}; allowed values: {', '.join(map(repr, SCHEME_EXPERT_KINDS))}")
        super().__init__(num_experts, hidden_dim, intermediate_dim, (kind, weights, inputs),
                         rules={"scale_rule": scale_rule}, layout="gpt-oss" if gpt_oss else "fused", act_fn=act_fn,
                         dtype=dtype, device=device)

    @property
    def kind(self) -> str:
        return self.stored[0]

    @property
    def weights(self) -> str:
        return self.stored[1]

    @property
    def inputs(self) -> Optional[str]:
        return self.stored[2]

    @property
    def gpt_oss(self) -> bool:
        return self.layout_name == "gpt-oss"


__all__ = ["SCHEME_EXPERT_KINDS", "SchemeExperts"]
