"""What the tests of ``blockscale.hf`` (quantization on load through transformers' ``from_pretrained``) share:
tiny models saved with ``save_pretrained``, the two ways to quantize them (on load, and ``bs.quantize_model`` on
the same checkpoint loaded in full precision) and a bit-for-bit comparison of state dicts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def saved(model, path, **save_args) -> Path:
    """``model.save_pretrained(path, **save_args)``; returns ``path``."""
    model.save_pretrained(path, **save_args)
    return Path(path)


def tiny_llama(layers: int = 2, dtype=torch.float32, seed: int = 0, vocab: int = 96):
    """A Llama of ``layers`` decoder layers (hidden 64, intermediate 128, GQA 4/2 heads) in ``dtype``."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def on_load(path, config, **load_args):
    """The checkpoint at ``path`` quantized as it loads (``quantization_config=config``)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **load_args)


def by_quantize_model(path, config, **load_args):
    """The checkpoint at ``path`` loaded in full precision, then ``bs.quantize_model(model, config.ptq_config)``."""
    from blockscale.ptq import quantize_model

    model = transformers.AutoModelForCausalLM.from_pretrained(path, **load_args)
    quantize_model(model, config.ptq_config, progress=False)
    return model


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width (floats compared bit for bit: -0 != 0, NaN == same NaN)."""
    return t.contiguous().view(_INT[t.element_size()]) if t.is_floating_point() else t


def state_differences(a, b) -> list[str]:
    """Keys whose tensors differ between modules (or state dicts) ``a`` and ``b`` in name, dtype, shape or bits."""
    sa = a if isinstance(a, dict) else a.state_dict()
    sb = b if isinstance(b, dict) else b.state_dict()
    out = sorted(set(sa) ^ set(sb))
    for k in sorted(set(sa) & set(sb)):
        x, y = sa[k], sb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
            out.append(k)
    return out


def decoder_linears(model) -> dict[str, torch.nn.Module]:
    """The plain ``nn.Linear`` modules inside the decoder layers, by name."""
    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".layers." in n}
