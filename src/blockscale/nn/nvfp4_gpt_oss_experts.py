"""NVFP4GptOssExperts: the NVFP4 name of ``QuantizedExperts`` for transformers' ``GptOssExperts`` (gpt-oss; the
layout: ``nn.gpt_oss_experts_layout``).

Each expert e stores the NVFP4 weights of the out x in matrices (as ``NVFP4Experts``): ``gate_up`` =
gate_up_proj[e]^T [2I, H], rows kept in the checkpoint's interleaved order, one FP32 outer scale per expert for
gate and up together (one tensor); ``down`` = down_proj[e]^T [H, I] with its own; the biases
``gate_up_proj_bias`` [E, 2I] / ``down_proj_bias`` [E, H] stay in high precision (the module's dtype).
"""
from __future__ import annotations

from typing import Optional

import torch

from .nvfp4_experts import NVFP4Experts


class NVFP4GptOssExperts(NVFP4Experts):
    """gpt-oss experts with NVFP4 weights, one outer scale per expert and projection (gate/up shared).

    Buffers as ``NVFP4Experts`` (gate_up [E, 2I, H] rows interleaved, down [E, H, I]) plus the biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] in the module's dtype.
    """

    experts_layouts = ("gpt-oss",)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__(num_experts, hidden_dim, intermediate_dim, input_scale_rule=input_scale_rule,
                         input_error=input_error, dtype=dtype, device=device)


__all__ = ["NVFP4GptOssExperts"]
