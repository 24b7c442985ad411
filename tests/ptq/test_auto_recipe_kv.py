"""The KV cache as a choice of the automatic recipe (issue 34, items 1-2): KV scores equal to an independent
computation from the attention's own projections and RoPE (Fisher: gradients through them), the choice within
the KV budget, the units' scores untouched by measuring the KV cache, the recipe's kv_cache reproduced through
YAML and PTQ, errors naming the argument, and the command line."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
from blockscale.errors import UsageError
from blockscale.nn.kv_cache import attention_modules, kv_format
from blockscale.ptq.auto_recipe import KV_CANDIDATES, AutoRecipeConfig, auto_recipe
from blockscale.recipes.ptq_builtin import get_ptq_recipe
from blockscale.recipes.ptq_recipe import KVCacheScheme
from blockscale.recipes.ptq_serialize import ptq_recipe_from_dict, ptq_recipe_to_dict

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from cli_runs import run_cli  # noqa: E402
from tiny_models import byte_llama_dir, tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(model, ids, batch_size, fisher):
    """Per layer: post-RoPE K (RoPE of k_proj's output, as the attention computes it) and V (v_proj's output),
    and for "fisher" dL/dK, dL/dV: from k_proj / v_proj output gradients, K's rotated by the same RoPE (RoPE is
    orthogonal, so dL/dK_post = R dL/dK_pre)."""
    calls = []
    for batch in ids.split(batch_size):
        seen, hooks = {}, []
        for name, attn in attention_modules(model).items():
            def pre(m, args, kwargs, name=name):
                seen.setdefault(name, {})["pe"] = kwargs["position_embeddings"]

            def proj(which, name=name):
                def hook(m, a, o):
                    if fisher:
                        o.retain_grad()
                    seen.setdefault(name, {})[which] = o
                return hook
            hooks += [attn.register_forward_pre_hook(pre, with_kwargs=True),
                      attn.k_proj.register_forward_hook(proj("k")), attn.v_proj.register_forward_hook(proj("v"))]
        with torch.set_grad_enabled(fisher):
            for p in model.parameters():
                p.requires_grad_(fisher)
            logits = model(input_ids=batch, use_cache=False).logits
            if fisher:
                F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                reduction="sum").backward()
        for h in hooks:
            h.remove()
        for name, d in seen.items():
            attn = attention_modules(model)[name]
            shape = (batch.shape[0], batch.shape[1], -1, attn.head_dim)
            cos, sin = d["pe"]
            k = d["k"].detach().view(shape).transpose(1, 2)
            v = d["v"].detach().view(shape).transpose(1, 2)
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            gk = gv = None
            if fisher:
                gk, _ = apply_rotary_pos_emb(d["k"].grad.view(shape).transpose(1, 2),
                                             d["k"].grad.view(shape).transpose(1, 2), cos, sin)
                gv = d["v"].grad.view(shape).transpose(1, 2)
            calls.append((name, k, v, gk, gv))
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(False)
    return calls


def _fq(name, t, amax):
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float()
    if name == "fp8-e4m3":  # E4M3 of t / s (clamped to +-448), times s
        return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    # NVFP4 along head_dim: outer encode scale 1 / s, E4M3 block scales, E2M1 values (the codec, blockscale's spec)
    q = bs.quantize(t.reshape(-1, t.shape[-1]), bs.NVFP4(), encode_scale=1 / s)
    return q.dequantize(torch.float32).reshape(t.shape)


@pytest.mark.parametrize("estimator", ["fisher", "output"])
def test_kv_scores_equal_an_independent_computation(estimator):
    model, ids = tiny_hf_llama(), token_ids(4, 16)
    r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, kv_cache_bits=16, estimator=estimator,
                                                 batch_size=2))
    calls = _reference(model, ids, 2, estimator == "fisher")
    amax = {}
    for name, k, v, _, _ in calls:
        a = amax.get(name, (torch.zeros(1), torch.zeros(1)))
        amax[name] = (torch.maximum(a[0], k.abs().amax().reshape(1)), torch.maximum(a[1], v.abs().amax().reshape(1)))
    per = 4 * 15 if estimator == "fisher" else 4 * 16
    for c, kv in enumerate(r.kv.names):
        want = 0.0
        if kv != "bf16":
            for name, k, v, gk, gv in calls:
                for j, (t, g) in enumerate(((k, gk), (v, gv))):
                    d = _fq(kv, t, amax[name][j]) - t
                    want += float((0.5 * (g * d).square() if g is not None else d.square()).double().sum())
        assert r.kv.scores[c] == pytest.approx(want / per, rel=1e-4), kv
    assert r.kv.scores[0] == 0.0 and 0 < r.kv.scores[1] < r.kv.scores[2]  # bf16 < FP8 < NVFP4


def test_kv_choice_within_its_budget_and_the_units_untouched():
    model, ids = tiny_hf_llama(), token_ids(4, 16)
    plain = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, batch_size=2))
    assert plain.kv is None and plain.recipe.kv_cache is None and "KV cache" not in "\n".join(plain.lines())
    want = {16: None, 12: KVCacheScheme("fp8-e4m3"), 8: KVCacheScheme("fp8-e4m3"), 4.5: KVCacheScheme("nvfp4")}
    for budget, kv in want.items():
        r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, kv_cache_bits=budget, batch_size=2))
        assert r.sensitivity.scores == plain.sensitivity.scores and r.recipe.rules == plain.recipe.rules
        assert r.recipe.kv_cache == kv and r.kv.chosen == (kv.format if kv else "bf16")
        assert r.kv.names == KV_CANDIDATES and r.to_dict()["kv_cache"]["chosen"] == r.kv.chosen
        assert ptq_recipe_from_dict(ptq_recipe_to_dict(r.recipe)) == r.recipe
        assert f"KV cache (budget {budget:g} bits" in "\n".join(r.lines())
    only = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, kv_cache_bits=8, kv_candidates="nvfp4",
                                                    batch_size=2))
    assert only.kv.names == ("nvfp4",) and only.recipe.kv_cache == KVCacheScheme("nvfp4")
    with pytest.raises(UsageError, match=r"kv_cache_bits=4 is below every usable KV candidate .*kv_cache_bits >= 4.5"):
        auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, kv_cache_bits=4, batch_size=2))


def test_the_chosen_kv_cache_is_calibrated_by_ptq():
    model, ids = tiny_hf_llama(), token_ids(4, 16)
    r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, kv_cache_bits=4.5, batch_size=2))
    bs.quantize_model(model, bs.PTQConfig(recipe=r.recipe), ids)
    assert {kv_format(a) for a in attention_modules(model).values()} == {"nvfp4"}


def test_bad_kv_arguments_are_usage_errors_naming_them():
    allowed = ", ".join(KV_CANDIDATES)
    for kw, msg in [({"kv_candidates": "nvfp4"}, "kv_candidates needs kv_cache_bits"),
                    ({"kv_cache_bits": -1}, "kv_cache_bits=-1: expected a finite number of bits per cached element"),
                    ({"kv_cache_bits": 8, "kv_candidates": "fp8"}, f"kv_candidates: 'fp8' is not supported; "
                                                                    f"allowed values: {allowed}"),
                    ({"kv_cache_bits": 8, "kv_candidates": "nvfp4,nvfp4"}, "kv_candidates: nvfp4 is given twice")]:
        with pytest.raises(UsageError, match=msg):
            AutoRecipeConfig(effective_bits=6, **kw)
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(  # head_dim 8: no NVFP4 KV cache
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4))
    r = auto_recipe(odd, token_ids(2, 16), AutoRecipeConfig(effective_bits=6, kv_cache_bits=8, batch_size=2))
    assert r.kv.scores[2] is None and r.kv.chosen == "fp8-e4m3"
    with pytest.raises(UsageError, match="kv_cache_bits=4.5 is below every usable KV candidate"):
        auto_recipe(odd, token_ids(2, 16), AutoRecipeConfig(effective_bits=6, kv_cache_bits=4.5, batch_size=2))


@pytest.fixture
def byte_model(tmp_path):
    return byte_llama_dir(tmp_path)


def test_cli_kv_cache_bits(byte_model, tmp_path, capsys):
    common = ["--calib", tmp_path / "cal.txt", "--n-samples", "4", "--seq-len", "32", "--batch-size", "2"]
    for argv, line in [(["--kv-cache-bits", "8"], "--kv-cache-bits needs --auto-recipe"),
                       (["--auto-recipe", "--effective-bits", "6", "--kv-candidates", "nvfp4"],
                        "--kv-candidates needs --kv-cache-bits"),
                       (["--auto-recipe", "--effective-bits", "6", "--kv-cache-bits", "8", "--kv-candidates", "x"],
                        "--kv-candidates: kv_candidates: 'x' is not supported")]:
        code, out, err = run_cli(["quantize", byte_model, "--out", tmp_path / "bad", *argv], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    out = tmp_path / "q"
    code, stdout, err = run_cli(["quantize", byte_model, "--auto-recipe", "--effective-bits", "6", "--kv-cache-bits",
                                 "4.5", *common, "--out", out, "--format", "modelopt"], capsys)
    assert code == 0, err
    assert "KV cache (budget 4.5 bits per cached element" in stdout and "nvfp4 (4.5 bits)" in stdout
    assert get_ptq_recipe(out / "auto_recipe.yaml").kv_cache == KVCacheScheme("nvfp4")
    report = json.loads((out / "ptq_report.json").read_text())["ptq"]["config"]["auto_recipe"]
    assert report["kv_cache"]["chosen"] == "nvfp4" and report["kv_cache"]["bits"] == [16.0, 8.0, 4.5]
    model = bs.load(out)
    assert {kv_format(a) for a in attention_modules(model).values()} == {"nvfp4"}
