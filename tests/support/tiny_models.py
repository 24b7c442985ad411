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


def tiny_family(family: str, n_kv: int = 4, seed: int = 0):
    """A 2-layer fp32 model of ``family`` (hidden 64, 4 heads of 16, ``n_kv`` KV heads, intermediate 128),
    with non-trivial norms (gains 0.5 .. 1.5, four channels x8: outliers as in real models) and biases."""
    import transformers as T

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=n_kv, max_position_embeddings=64)
    head = dict(head_dim=16)
    cfg, M = {
        "llama": (lambda: T.LlamaConfig(**common), T.LlamaForCausalLM),
        "mistral": (lambda: T.MistralConfig(**common, **head), T.MistralForCausalLM),
        "qwen2": (lambda: T.Qwen2Config(**common), T.Qwen2ForCausalLM),
        "qwen3": (lambda: T.Qwen3Config(**common, **head), T.Qwen3ForCausalLM),
        "gemma": (lambda: T.GemmaConfig(**common, **head), T.GemmaForCausalLM),
        "gemma2": (lambda: T.Gemma2Config(**common, **head, sliding_window=16), T.Gemma2ForCausalLM),
        "gemma3": (lambda: T.Gemma3TextConfig(**common, **head, sliding_window=16,
                                              layer_types=["sliding_attention", "full_attention"]),
                   T.Gemma3ForCausalLM),
        "phi3": (lambda: T.Phi3Config(**common, pad_token_id=0, eos_token_id=1, bos_token_id=1), T.Phi3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = M(cfg()).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m).__name__.endswith("RMSNorm"):
                gain = 0.5 + torch.rand(m.weight.shape, generator=g)
                gain[torch.randperm(gain.numel(), generator=g)[:4]] *= 8.0
                m.weight.copy_(gain - 1.0 if type(m).__name__.startswith("Gemma") else gain)
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # Qwen2's q/k/v biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def byte_llama_dir(tmp_path):
    """A saved tiny 2-layer Llama with the byte-level tokenizer (``tmp_path / "src"``) and a calibration text file
    ``tmp_path / "cal.txt"``: what ``blockscale quantize`` tests start from."""
    import transformers

    from blockscale.models.hf_moe_export import byte_transformers_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    byte_transformers_tokenizer().save_pretrained(tmp_path / "src")
    (tmp_path / "cal.txt").write_text("Once upon a time there was a little robot who loved to count the stars. " * 20)
    return tmp_path / "src"


def assert_reloads_bit_exact(model, directory, fmt: str = "compressed-tensors", x=None) -> None:
    """Export ``model`` to ``directory`` in ``fmt``, load it back (``export.load_checkpoint``) and check the
    reloaded model's logits equal the model's bit for bit (on ``x``, default 2 x 16 tokens)."""
    from blockscale.export import export_checkpoint, load_checkpoint

    x = token_ids(2, 16, seed=7) if x is None else x
    with torch.no_grad():
        ref = model(x).logits
    loaded = load_checkpoint(export_checkpoint(model, directory, fmt))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref)
