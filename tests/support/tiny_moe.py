"""Tiny random MoE models for tests (built from a config: no download): the fused 3-D experts of
transformers >= 5 Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE (``tiny_moe``), gpt-oss (``tiny_gpt_oss``) and
DeepSeek-V3 (``tiny_deepseek``), all with E = 4 experts, hidden size H = 64, expert intermediate size I = 64;
``gpt_oss_glu``: gpt-oss's clamped GLU on interleaved gate / up columns, written by hand."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

E, H, I, TOPK = 4, 64, 64, 2  # experts, hidden, expert intermediate size, experts per token (gpt-oss)
COMMON = dict(vocab_size=96, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def tiny_moe(family: str, top_k: int = 2, seed: int = 0):
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=I, num_experts=E,
                                          num_experts_per_tok=top_k, head_dim=16)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=I, num_experts=E, num_experts_per_tok=top_k)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=I, num_experts=E,
                                          num_experts_per_tok=top_k, shared_expert_intermediate_size=64)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tiny_gpt_oss(plain: bool = False):
    """gpt-oss, 2 layers (sliding, full attention), 4 experts, top-2. By default with non-zero expert biases and
    weights large enough for the clamp (limit 7) to matter; ``plain``: as ``from_config`` builds it."""
    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=E,
                                    num_experts_per_tok=TOPK, max_position_embeddings=64,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if plain:
        return model
    with torch.no_grad():  # non-zero biases and weights large enough for the clamp (limit 7) to matter
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.mul_(20)
            ex.gate_up_proj_bias.normal_(0, 0.5)
            ex.down_proj_bias.normal_(0, 0.5)
    return model


def gpt_oss_glu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gu[..., 0::2].clamp(max=limit), gu[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def tiny_deepseek(seed: int = 0):
    """DeepSeek-V3 from a config: layer 0 dense, layer 1 MoE (4 routed experts, 1 shared, grouped top-2),
    MLA with q_lora_rank (q_a_proj 64 -> 32, kv_a_proj_with_mqa 64 -> 32 + 16)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # a non-trivial correction bias, so "written as is" can fail
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.25, -0.5, 1.0 / 3, 2.0]))
    return model
