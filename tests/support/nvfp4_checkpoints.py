"""The tiny NVFP4 Llama of the checkpoint export tests (tests/export/): ``make_model`` quantizes its decoder
Linears as the PTQ pipeline does (one encode scale per fused group), ``sample_ids`` / ``model_logits`` are the
inputs and logits a reloaded checkpoint is compared on, ``nvfp4_linears`` lists its quantized modules."""
import pytest
import torch

import blockscale as bs
from blockscale.nn import NVFP4Linear
from blockscale.nn.fused import fused_groups
from blockscale.quant.nvfp4 import input_encode_scale, outer_scale

transformers = pytest.importorskip("transformers")

CT, MO = "compressed-tensors", "modelopt"
VOCAB = 64


def replace_module(root, name, new):
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent), child, new)


def make_model(dtype=torch.float32, *, act=None, weight_rule="6", bias=False, tied=True, layers=2, seed=0,
               keep=(), unshared=False):
    """A tiny Llama whose decoder Linears are NVFP4Linear, quantized as the PTQ pipeline does: one
    encode scale S per fused group; ``act``: None (W4A16), "6", "4over6" or "mixed" (per module);
    ``keep``: Linear names left in high precision; ``unshared``: per-module S (invalid)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    spec = bs.NVFP4(scale_rule=weight_rule)
    lins = {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n and n not in keep}
    with torch.no_grad():
        for m in lins.values():
            m.weight.mul_(torch.rand(m.out_features, 1, generator=g).to(dtype) * 3)  # distinct amax per module
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.out_features, generator=g).to(dtype) * 0.1)
    model.test_group_amax = {}
    for group in fused_groups(list(lins)):
        amaxes = [lins[n].weight.detach().float().abs().max() for n in group]
        S = outer_scale(torch.stack(amaxes).max(), spec.outer_bound)
        model.test_group_amax.update({n: torch.stack(amaxes).max() for n in group})
        in_amax = 2.0 + float(torch.rand((), generator=g)) * 4
        for n, a in zip(group, amaxes):
            q = bs.quantize(lins[n].weight.detach(), spec, encode_scale=outer_scale(a, spec.outer_bound)
                            if unshared else S)
            kw = {}
            if act is not None:
                rule = act if act != "mixed" else ("4over6" if ".mlp." in n else "6")
                kw = dict(input_global_scale=input_encode_scale(in_amax, rule), input_scale_rule=rule,
                          input_error="mae" if act == "mixed" and ".v_proj" in n else "mse")
            replace_module(model, n, NVFP4Linear.from_quantized(q, lins[n].bias, dtype=dtype, **kw))
    return model


def sample_ids(seed=0):
    """[2, 9] seeded token ids below ``VOCAB``."""
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def model_logits(model):
    """``model``'s logits on ``sample_ids()``, without autograd."""
    with torch.no_grad():
        return model(sample_ids()).logits


def nvfp4_linears(model):
    """{name: module} of every NVFP4Linear in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
