"""Tiny random transformers models for tests (built from a config: no download)."""
from __future__ import annotations

import torch


def tiny_hf_llama(seed: int = 0):
    """A 2-layer LlamaForCausalLM (vocab 96, hidden 64, GQA 4/2 heads), fp32, eval mode."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def logits(model, x: torch.Tensor) -> torch.Tensor:
    """``model``'s logits on token ids ``x``, without autograd."""
    with torch.no_grad():
        return model(x).logits


def llama_and_its_4over6_ptq():
    """(``tiny_hf_llama()``, a copy quantized to NVFP4 by ``quantize_model`` with the 4/6 scale rule)."""
    import copy

    from blockscale.ptq import PTQConfig, quantize_model

    teacher = tiny_hf_llama()
    ptq = copy.deepcopy(teacher)
    quantize_model(ptq, PTQConfig(scale_rule="4over6"), progress=False)
    return teacher, ptq


def token_ids(n: int = 8, t: int = 32, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    """[n, t] seeded random token ids."""
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def checkpoint_tensors(path) -> dict:
    """Every tensor of every ``*.safetensors`` file in directory ``path`` (name -> tensor)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def moe_ids() -> torch.Tensor:
    """The [2, 9] token ids the MoE export tests compare logits on."""
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))


def moe_logits(model) -> torch.Tensor:
    """``model``'s logits on ``moe_ids()``, without autograd."""
    with torch.no_grad():
        return model(moe_ids()).logits
