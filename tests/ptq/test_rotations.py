"""PTQ with rotations (blockscale.ptq.rotations, ``PTQConfig(rotate=...)``, ``quantize --rotate``): the plan's
grammar, every fused rotation leaving the full-precision function unchanged (within FP32 rounding) on each dense
family, online rotations equal to their explicit products, MR-GPTQ with the identity rotation equal to today's
GPTQ bit for bit, every method and scale rule running rotated, AWQ skipping the groups whose inputs are rotated,
and the refusals (Gemma 2 / 3 R1, MLA layers, streaming)."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale.errors import QuantizationError, UsageError
from blockscale.nn.input_rotation import input_rotation, input_rotations
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.rotations import ROTATE_CHOICES, RotationPlan, parse_rotate, rotate_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_family, tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 16, seed=3)
CALIB = token_ids(8, 32, seed=0)


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("text, want", [
    ("none", RotationPlan()), ("r4", RotationPlan(r4=True)), ("R1R2", RotationPlan(r1=True, r2=True)),
    ("r1r2r4", RotationPlan(r1=True, r2=True, r4=True)), ("quip", RotationPlan(inputs="full")),
    ("block:32", RotationPlan(inputs=32)), ("mr", RotationPlan(inputs="group")),
    ("r1r2+block:16", RotationPlan(r1=True, r2=True, inputs=16)), ("r1+r2", RotationPlan(r1=True, r2=True))])
def test_parse_rotate(text, want):
    plan = parse_rotate(text)
    assert plan == want
    assert parse_rotate(plan.label) == plan  # the label round-trips


@pytest.mark.parametrize("text, match", [("bogus", "unknown token 'bogus'"), ("block:12", "power of two"),
                                         ("block:x", "needs a power of two"), ("r4+quip", "rotated twice"),
                                         ("quip+mr", "one input rotation"), ("", "allowed: none, r4")])
def test_parse_rotate_errors(text, match):
    with pytest.raises(UsageError, match=match):
        parse_rotate(text)
    assert ROTATE_CHOICES == ("none", "r4", "r1r2", "r1r2r4", "r3", "r1r2r3r4", "quip", "block:N", "mr")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
@pytest.mark.parametrize("rotate", ["r1r2", "r1r2r4", "quip", "block:16"])
def test_rotations_keep_the_function(family, rotate):
    model = tiny_family(family, n_kv=2)
    ref = _logits(model)
    report = rotate_model(model, parse_rotate(rotate, seed=5))
    assert _rel(_logits(model), ref) < 1e-5, report.lines()  # FP64 folds, one FP32 rounding per weight (a wrong fold: O(1))
    if "r1" in rotate:
        assert any(line.startswith("R1 random-hadamard 64") for line in report.fused)
        norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")
                 and not n.endswith(("q_norm", "k_norm"))]
        want = 0.0 if family == "gemma" else 1.0
        assert all(bool((m.weight == want).all()) for m in norms)  # every norm weight folded away


def test_r1_unties_embeddings_and_rotates_them():
    model = tiny_hf_llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    ref = _logits(model)
    emb = model.model.embed_tokens.weight.detach().clone()
    report = rotate_model(model, RotationPlan(r1=True))
    assert report.untied and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    from blockscale.quant.transforms.rotation import rotation

    assert torch.equal(model.model.embed_tokens.weight, rotation("random-hadamard", 64, 0).fold_input(emb))
    assert _rel(_logits(model), ref) < 2e-6


def test_r4_is_online_on_down_proj():
    model = tiny_hf_llama()
    x = torch.randn(3, 128)
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        want = down(x)
    report = rotate_model(model, RotationPlan(r4=True))
    assert report.online == {"R4": ("hadamard 128", 2)}
    assert set(input_rotations(model)) == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    q = torch.block_diag(input_rotation(down).matrix())
    with torch.no_grad():
        assert torch.allclose(down(x), want, atol=1e-5, rtol=0)
        explicit = torch.nn.functional.linear(x.double() @ q, down.weight.double())  # x Q (W Q)^T
    assert torch.allclose(down(x).double(), explicit, atol=1e-6, rtol=0)


@pytest.mark.parametrize("acts", ["w4a16", "w4a4"])
@pytest.mark.parametrize("scale_rule", ["6", "4over6"])
def test_mr_gptq_with_the_identity_rotation_is_gptq(acts, scale_rule):
    plain, rotated = tiny_hf_llama(), tiny_hf_llama()
    cfg = PTQConfig(method="gptq", activations=acts, scale_rule=scale_rule)
    quantize_model(plain, cfg, CALIB, progress=False)
    rotate_model(rotated, RotationPlan(inputs=16, online_kind="identity"))
    quantize_model(rotated, cfg, CALIB, progress=False)
    assert len(input_rotations(rotated)) == 14  # carried onto the quantized modules
    for (n, a), (_, b) in zip(plain.state_dict().items(), rotated.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(_logits(plain), _logits(rotated))


@pytest.mark.filterwarnings("ignore:.*not smoothed:RuntimeWarning")
@pytest.mark.parametrize("method, rule", [("rtn", "6"), ("rtn", "4over6"), ("rtn", "sweep"), ("rtn", "hessian"),
                                          ("gptq", "6"), ("awq", "6"), ("smoothquant", "6")])
@pytest.mark.parametrize("rotate", ["r1r2r4", "mr"])
def test_every_method_and_rule_runs_rotated(method, rule, rotate):
    model = tiny_hf_llama()
    ref = _logits(model)
    acts = "w4a4" if method == "smoothquant" else "w4a16"
    report = quantize_model(model, PTQConfig(method=method, scale_rule=rule, activations=acts, rotate=rotate),
                            CALIB, progress=False)
    assert report.rotation[0] == f"rotate {rotate}:" and report.config["rotate"] == rotate
    assert bool(torch.isfinite(_logits(model)).all()) and _rel(_logits(model), ref) < 0.5


def test_awq_skips_groups_whose_inputs_are_rotated():
    model = tiny_hf_llama()
    with pytest.warns(RuntimeWarning, match="down_proj: not smoothed \\(its Linears' inputs are rotated online\\)"):
        report = quantize_model(model, PTQConfig(method="awq", rotate="r4"), CALIB, progress=False)
    downs = [lr for lr in report.linears if lr.name.endswith("down_proj")]
    others = [lr for lr in report.linears if not lr.name.endswith(("down_proj", "o_proj"))]
    assert all(lr.smoothing_alpha is None for lr in downs)  # up -> down: not smoothed (down's input rotated)
    assert all(lr.smoothing_alpha is not None for lr in others)


def test_mr_follows_the_scheme_group():
    from blockscale.recipes.ptq_recipe import PTQRecipe, PTQRule, Scheme

    recipe = PTQRecipe("mix", default=Scheme("nvfp4-w4a4"), rules=(PTQRule("mlp", Scheme("mxfp4")),
                                                                    PTQRule("*.o_proj", Scheme("fp8-w8a8"))))
    model = tiny_hf_llama()
    report = quantize_model(model, PTQConfig(recipe=recipe, rotate="mr"), CALIB, progress=False)
    sizes = {n: r.size for n, (_, r) in input_rotations(model).items()}
    assert sizes["model.layers.0.self_attn.q_proj"] == 16 and sizes["model.layers.0.mlp.up_proj"] == 32
    assert "model.layers.0.self_attn.o_proj" not in sizes
    assert any("o_proj" in s and "no 16 / 32 quantization group" in s for s in report.rotation)


def test_refusals():
    with pytest.raises(QuantizationError, match="sandwich norms"):
        rotate_model(tiny_family("gemma2"), RotationPlan(r1=True))
    rotate_model(tiny_family("gemma2"), RotationPlan(r4=True))  # online rotations are fine there
    from tiny_moe import tiny_deepseek  # MoE layers rotate (test_rotations_moe.py); MLA is refused

    with pytest.raises(QuantizationError, match="MLA"):
        rotate_model(tiny_deepseek(), RotationPlan(r4=True))
    model = tiny_hf_llama()
    rotate_model(model, RotationPlan(r4=True))
    with pytest.raises(QuantizationError, match="rotated twice"):
        rotate_model(model, RotationPlan(r4=True))
    before = copy.deepcopy(tiny_hf_llama().state_dict())
    bad = tiny_hf_llama()
    with pytest.raises(QuantizationError):
        rotate_model(bad, RotationPlan(inputs=256))  # 64 inputs: refused before any weight changed
    assert all(torch.equal(before[k], v) for k, v in bad.state_dict().items())


def test_streaming_refuses_rotations(tmp_path):
    from blockscale.ptq.streaming import quantize_streaming

    tiny_hf_llama().save_pretrained(tmp_path / "hf")
    with pytest.raises(UsageError, match="rotate='r4' needs the whole model in memory"):
        quantize_streaming(tmp_path / "hf", tmp_path / "out", PTQConfig(rotate="r4"), progress=False)
    assert not (tmp_path / "out").exists()
