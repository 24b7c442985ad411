"""The scale-learning write-up's pipeline end to end on stories260K, through the command line
(docs/ptq.md, "Mixed precision"): quantize with the mixed recipe (NVFP4 W4A4 MLPs, FP8 W8A8
attention, FP8 KV cache, swept block scales) -> learn-scales (scale-only) -> reload and evaluate."""
from __future__ import annotations

import json

import torch

import blockscale as bs
from blockscale import cli
from blockscale.nn import FP8Linear, NVFP4Linear
from blockscale.nn.kv_cache import attention_modules, kv_scales

EVAL = "tinystories#0:0.01"


def _kinds(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (FP8Linear, NVFP4Linear))}


def test_write_up_pipeline_on_stories260k(tmp_path, capsys):
    a, b = tmp_path / "A", tmp_path / "B"
    assert cli.main(["quantize", "stories260k", "--recipe", "nvfp4-experts-fp8-attention", "--scale-rule", "sweep",
                     "--n-samples", "8", "--seq-len", "64", "--out", str(a)]) == 0
    model_a = bs.load(a)
    kinds = _kinds(model_a)
    attn = [n for n in kinds if ".self_attn." in n]
    mlp = [n for n in kinds if ".mlp." in n]
    assert attn and all(kinds[n] == "FP8Linear" for n in attn)
    assert mlp and all(kinds[n] == "NVFP4Linear" for n in mlp)  # gate/up (down_proj: 172 inputs, kept)
    assert all(model_a.get_submodule(n).input_global_scale is not None for n in mlp)  # W4A4
    attns = attention_modules(model_a)
    assert attns and all(kv_scales(m) is not None for m in attns.values())
    qcfg = json.loads((a / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["num_bits"] == 8 and qcfg["format"] == "mixed-precision"

    capsys.readouterr()
    assert cli.main(["learn-scales", str(a), "--teacher", "stories260k", "--steps", "3", "--lr-scales", "0.1", "--n-samples", "8",
                     "--seq-len", "64", "--batch-size", "2", "--eval", EVAL, "--out", str(b)]) == 0
    rep = json.loads((b / "lsq_report.json").read_text())
    assert rep["distill"]["steps"] == 3
    model_b = bs.load(b)
    assert _kinds(model_b) == kinds
    # the FP8 attention and the KV scales are fixed in this step: stored bytes unchanged
    for n in attn:
        qa, qb = model_a.get_submodule(n), model_b.get_submodule(n)
        assert torch.equal(qa.weight.view(torch.uint8), qb.weight.view(torch.uint8))
        assert torch.equal(qa.weight_scale, qb.weight_scale) and torch.equal(qa.input_scale, qb.input_scale)
    for name, m in attention_modules(model_b).items():
        ka, va = kv_scales(attns[name])
        kb, vb = kv_scales(m)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # the NVFP4 block scales did learn
    changed = sum(int((model_a.get_submodule(n).weight_scale.view(torch.uint8)
                       != model_b.get_submodule(n).weight_scale.view(torch.uint8)).sum()) for n in mlp)
    assert changed > 0
    # eval ppl of the reloaded B is the "after" perplexity learn-scales measured in memory
    out = tmp_path / "e.json"
    assert cli.main(["eval", "ppl", str(b), "--data", EVAL, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["loss"] == rep["perplexity"]["after"]["loss"]


def test_learn_scales_from_a_model_name_with_a_recipe(tmp_path, capsys):
    """learn-scales MODEL --recipe: RTN with the recipe, then only the NVFP4 modules learn; on a checkpoint
    input the initialisation flags are usage errors (it was quantized already)."""
    out = tmp_path / "L"
    assert cli.main(["learn-scales", "stories260k", "--recipe", "nvfp4-experts-fp8-attention", "--steps", "2",
                     "--n-samples", "8", "--seq-len", "64", "--batch-size", "2", "--out", str(out)]) == 0
    model = bs.load(out)
    kinds = set(_kinds(model).values())
    assert kinds == {"FP8Linear", "NVFP4Linear"}
    assert all(kv_scales(m) is not None for m in attention_modules(model).values())
    capsys.readouterr()
    assert cli.main(["learn-scales", str(out), "--teacher", "stories260k", "--recipe", "fp8",
                     "--out", str(tmp_path / "M")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--recipe" in err[0] and "quantized checkpoint already" in err[0]
