"""Issue 16 (D): scale learning on fused MoE experts (``lsq.enable`` on ``NVFP4Experts``) and training recipes on
transformers' fused experts (``convert`` -> ``QuantizedFusedExperts``).

LSQ: per-expert block amaxes [E, rows, inputs/16], per-expert outer scales fixed; the step-0 forward equals
the PTQ model's bit for bit (W4A16 and W4A4, tied and dual); the stacked learner equals one NVFP4ScaleLearner
per expert (forward and gradients); gradients reach every routed expert's amaxes; a few distillation steps
lower the loss; freeze / export / load is exact; ``blockscale learn-scales`` runs on an MoE checkpoint.
convert: the same Parameters; a no-quantization FP32 recipe gives the HF forward bit for bit; NVFP4 equals a
by-hand per-expert reference; backward and an optimizer step on the HF model's own parameters work.
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
from blockscale import lsq
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn import EXPERTS_ONLY_EXCLUDE, NVFP4Experts, QuantizedFusedExperts, experts_only
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.recipes import LinearRecipe, Recipe

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, H, I, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
U8, E4M3 = torch.uint8, torch.float8_e4m3fn


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _experts(model, cls):
    return {n: m for n, m in model.named_modules() if isinstance(m, cls)}


def _ptq(family, act="w4a16", seed=0, **cfg):
    """(float model, RTN-quantized copy)."""
    fp = tiny_moe(family, seed=seed)
    q = copy.deepcopy(fp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the routers stay in high precision
        quantize_model(q, PTQConfig(activations=act, **cfg), token_ids(4, 16, seed=3) if act == "w4a4" else None,
                       progress=False)
    return fp, q


# ----------------------------------------------------------------------------- LSQ on NVFP4Experts

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_step0_equals_the_ptq_model_bit_for_bit(family, act, mode):
    _, model = _ptq(family, act)
    x = token_ids(2, 16)
    want = logits(model, x)
    stored = {n: {k: v.clone() for k, v in m.named_buffers()} for n, m in _experts(model, NVFP4Experts).items()}
    names = lsq.enable(model, mode=mode)
    ex = _experts(model, lsq.LSQExperts)
    assert sorted(ex) == sorted(stored) and set(stored) <= set(names)
    assert not _experts(model, NVFP4Experts).keys() - {f"{n}.base" for n in ex}
    for n, m in ex.items():
        for p, (rows, k) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            learner = getattr(m, p)
            amaxes = [learner.amax] if mode == "tied" else [learner.amax_pre, learner.amax_post]
            assert all(a.shape == (E, rows, k // 16) and a.requires_grad for a in amaxes)
            # the outer scales stay what PTQ chose (a buffer, not trained)
            assert torch.equal(learner.encode_scale, stored[n][f"{p}_weight_global_scale"])
            assert not any(t is learner.encode_scale for t in lsq.scale_parameters(model))
        assert (m.base.input_scale_rule is None) == (act == "w4a16")
    assert torch.equal(logits(model, x), want)
    # and so is the eager experts implementation (the path of NVFP4Experts' own forward for W4A4)
    model.set_experts_implementation("eager")
    assert torch.equal(logits(model, x), want)


def _deepseek():
    from tiny_moe import tiny_deepseek

    return tiny_deepseek()


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral_bf16"])
def test_step0_equals_the_ptq_model_deepseek_and_bfloat16(family):
    model = _deepseek() if family == "deepseek_v3" else tiny_moe("mixtral").to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        quantize_model(model, PTQConfig(), progress=False)
    x = token_ids(2, 16)
    want = logits(model, x)
    names = lsq.enable(model, mode="dual")
    assert names[-1] == "model.layers.1.mlp.experts" and _experts(model, lsq.LSQExperts)
    assert torch.equal(logits(model, x), want)


def test_init_rule_with_the_float_weights_equals_rtn_with_that_rule():
    fp, model = _ptq("mixtral", scale_rule="4over6")
    x = token_ids(2, 16)
    want = logits(model, x)
    lsq.enable(model, init="4over6", weights=fp)
    assert torch.equal(logits(model, x), want)
    ex = model.model.layers[0].mlp.experts
    assert torch.equal(ex.gate_up.weight, fp.model.layers[0].mlp.experts.gate_up_proj.detach())
    _, model2 = _ptq("mixtral", exclude=(EXPERTS_ONLY_EXCLUDE,), allow_partial=True)  # only experts quantized
    with pytest.raises(ValueError, match="gate_up_proj: latent weight"):
        lsq.enable(model2, weights={"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 3)})


@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_stacked_learner_equals_one_scale_learner_per_expert(mode):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 32, 48, generator=g) * torch.tensor([0.5, 2.0, 0.01])[:, None, None]
    S = torch.tensor([900.0, 30.0, 41000.0])
    stacked = lsq.NVFP4ExpertsScaleLearner(w, S, mode=mode, init="4over6", train_weight=True)
    singles = [lsq.NVFP4ScaleLearner(w[e], S[e], mode=mode, init="4over6", train_weight=True) for e in range(3)]
    for name in ("amax",) if mode == "tied" else ("amax_pre", "amax_post"):
        assert torch.equal(getattr(stacked, name), torch.stack([getattr(s, name) for s in singles]))
    if mode == "dual":  # move them apart so that both branches of the dual gradient are exercised
        with torch.no_grad():
            stacked.amax_post.mul_(1.1)
            for s in singles:
                s.amax_post.mul_(1.1)
    gout = torch.randn(3, 32, 48, generator=g)
    out = stacked()
    assert torch.equal(out, torch.stack([s() for s in singles]))
    (out * gout).sum().backward()
    for e, s in enumerate(singles):
        (s() * gout[e]).sum().backward()
        for name, p in s.named_parameters():
            assert torch.equal(getattr(stacked, name).grad[e], p.grad), (e, name)
    codes, scales = stacked.codes_and_scales()
    for e, s in enumerate(singles):
        q = s.to_quantized()
        assert torch.equal(codes[e], q.codes) and torch.equal(scales[e].view(U8), q.scales.view(U8))


def test_gradients_reach_every_routed_expert_amax():
    _, model = _ptq("qwen3_moe", "w4a4")
    lsq.enable(model, mode="dual")
    x = token_ids(4, 16)
    # which experts each layer routes x to (recorded on the LSQExperts' inputs)
    routed = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: routed.__setitem__(n, set(args[1].flatten().tolist())))
             for n, m in _experts(model, lsq.LSQExperts).items()]
    out = model(x).logits
    for h in hooks:
        h.remove()
    F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1)).backward()
    for n, m in _experts(model, lsq.LSQExperts).items():
        for learner in m.learners().values():
            for a in (learner.amax_pre, learner.amax_post):
                per_expert = a.grad.abs().flatten(1).sum(1)
                for e in range(E):
                    assert (per_expert[e] > 0) == (e in routed[n]), (n, e)
            assert learner.weight.grad is None  # latent weights frozen by default
    assert routed and all(routed.values())


def _distill_setup(family="mixtral"):
    """Teacher (float; experts x8 and the head x8, so that the 4-bit experts' error is visible in the logits of a
    random model) and a student with only its experts quantized (RTN): what distillation improves is their
    block scales."""
    teacher = tiny_moe(family)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8)
        for layer in teacher.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(8)
            layer.mlp.experts.down_proj.mul_(8)
    student = copy.deepcopy(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        quantize_model(student, PTQConfig(exclude=(EXPERTS_ONLY_EXCLUDE,), allow_partial=True), progress=False)
    assert not any(isinstance(m, bs.NVFP4Linear) for m in student.modules())
    return teacher, student


def _kl(student, teacher, x):
    with torch.no_grad():
        return float(lsq.distill_loss(student(x).logits, teacher(x).logits, x)[1])


def test_a_few_distillation_steps_lower_the_loss():
    teacher, student = _distill_setup()
    lsq.enable(student, mode="tied")
    train, held_out = token_ids(32, 32, seed=5), token_ids(8, 32, seed=7)
    before = (_kl(student, teacher, train), _kl(student, teacher, held_out))
    amax0 = [p.detach().clone() for p in lsq.scale_parameters(student)]
    assert len(amax0) == 4  # 2 layers x (gate_up, down): nothing else learns
    res = lsq.distill(student, teacher, train, lsq.DistillConfig(steps=40, lr_scales=3e-3, batch_size=8, seq_len=32),
                      progress=False)
    after = (_kl(student, teacher, train), _kl(student, teacher, held_out))
    assert res["steps"] == 40 and res["final_loss"] < res["first_loss"]
    assert after[0] < 0.95 * before[0] and after[1] < 0.95 * before[1], (before, after)  # ~10% lower, both
    assert all(not torch.equal(a, p) for a, p in zip(amax0, lsq.scale_parameters(student)))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_freeze_export_load_round_trip_is_exact(tmp_path, fmt, act):
    _, model = _ptq("qwen3_moe", act)
    before = {n: {k: v.clone() for k, v in m.named_buffers()} for n, m in _experts(model, NVFP4Experts).items()}
    lsq.enable(model, mode="dual")
    with torch.no_grad():  # a "learned" change of the scales: every amax_post of some blocks moves
        for p in lsq.scale_parameters(model):
            if p.dim() == 3:
                p[:, ::3].mul_(1.3)
    x = token_ids(2, 16)
    learned = logits(model, x)
    fq = {n: (m.gate_up().to(m.base.weight_dtype), m.down().to(m.base.weight_dtype))
          for n, m in _experts(model, lsq.LSQExperts).items()}
    frozen = lsq.freeze(model)
    assert set(fq) <= set(frozen) and not _experts(model, lsq.LSQExperts)
    for n, m in _experts(model, NVFP4Experts).items():
        gu, dn = m.dequantized()
        assert torch.equal(gu, fq[n][0]) and torch.equal(dn, fq[n][1])
        for k, v in m.named_buffers():
            if "global_scale" in k:  # outer and input scales unchanged
                assert torch.equal(v, before[n][k]), k
        assert not torch.equal(m.gate_up_weight_scale.view(U8), before[n]["gate_up_weight_scale"].view(U8))
    assert torch.equal(logits(model, x), learned)
    back = load_checkpoint(export_checkpoint(model, tmp_path / "ck", fmt))
    mods = dict(model.named_modules())
    for n, m in _experts(back, NVFP4Experts).items():
        for k, v in m.named_buffers():
            w = getattr(mods[n], k)
            if v.dtype == E4M3:
                v, w = v.view(U8), w.view(U8)
            elif fmt == "modelopt" and k.endswith("_weight_global_scale"):  # stores fl(1/S)
                v, w = 1.0 / v, 1.0 / w
            assert torch.equal(v, w), (n, k)
    assert len(_experts(back, NVFP4Experts)) == 2
    assert torch.equal(logits(back, x), learned)


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}  # 96 ids: the tiny models' vocabulary
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("family,source", [("mixtral", "checkpoint"), ("qwen3_moe", "checkpoint"),
                                           ("qwen3_moe", "model")])
def test_learn_scales_cli_on_an_moe_checkpoint(tmp_path, family, source, capsys):
    """``blockscale learn-scales CKPT --teacher FP`` (or ``learn-scales FP``: RTN first) on a tiny MoE model, then
    ``bs.load`` of the result: NVFP4Experts with the RTN model's outer scales and learned block scales."""
    from blockscale import cli

    teacher, student = _ptq(family)
    tok = _char_tokenizer()
    teacher.save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    ckpt = export_checkpoint(student, tmp_path / "ck", "compressed-tensors", tokenizer=tok)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little fox who liked to run in the woods. " * 40)
    out = tmp_path / "learned"
    given = [str(ckpt), "--teacher", str(tmp_path / "fp")] if source == "checkpoint" else [str(tmp_path / "fp")]
    assert cli.main(["learn-scales"] + given + ["--out", str(out), "--steps", "3", "--n-samples", "4",
                                                "--seq-len", "32", "--batch-size", "2", "--lr-scales", "1e-1",
                                                "--data", str(text)]) == 0
    assert "wrote compressed-tensors checkpoint with learned scales" in capsys.readouterr().out
    report = json.loads((out / "lsq_report.json").read_text())
    assert report["distill"]["steps"] == 3
    back, orig = bs.load(out), load_checkpoint(ckpt)
    ex_back, ex_orig = _experts(back, NVFP4Experts), _experts(orig, NVFP4Experts)
    assert sorted(ex_back) == sorted(ex_orig) and len(ex_back) == 2
    changed = False
    for n, m in ex_back.items():
        o = ex_orig[n]
        for p in ("gate_up", "down"):
            assert torch.equal(getattr(m, f"{p}_weight_global_scale"), getattr(o, f"{p}_weight_global_scale"))
            changed |= not torch.equal(getattr(m, f"{p}_weight_scale").view(U8),
                                       getattr(o, f"{p}_weight_scale").view(U8))
    assert changed  # the experts' block scales learned something
    x = token_ids(2, 16)
    assert torch.isfinite(logits(back, x)).all()


# ----------------------------------------------------------------------------- convert on HF fused experts

FP32 = Recipe("fp32", LinearRecipe(unquantized_dtype="float32"))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3"])
def test_convert_without_quantization_equals_the_hf_forward(family):
    hf = _deepseek() if family == "deepseek_v3" else tiny_moe(family)
    model = copy.deepcopy(hf)
    layers = (1,) if family == "deepseek_v3" else (0, 1)  # DeepSeek-V3: layer 0 is dense
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = token_ids(2, 16)
    rep = bs.convert(model, FP32)
    ex = _experts(model, QuantizedFusedExperts)
    assert sorted(ex) == sorted(rep.experts) == [f"model.layers.{i}.mlp.experts" for i in layers]
    assert all(rep.converted[n] == "fp32" for n in ex) and not rep.unsupported
    assert f"and {len(layers)} fused experts modules converted" in str(rep)
    for n, m in ex.items():  # the very same Parameter objects, under the same names
        assert m.gate_up_proj is params[f"{n}.gate_up_proj"] and m.down_proj is params[f"{n}.down_proj"]
    assert list(model.state_dict()) == keys
    assert torch.equal(logits(model, x), logits(hf, x))
    hf.set_experts_implementation("eager")
    assert torch.equal(logits(model, x), logits(hf, x))
    again = bs.convert(model, "nvfp4-nvidia")  # converting again only changes the recipe
    assert _experts(model, QuantizedFusedExperts) == ex and again.experts == rep.experts
    assert all(m.recipe == bs.get_recipe("nvfp4-nvidia").linear for m in ex.values())
    assert bs.unconvert(model) >= len(layers) and not _experts(model, QuantizedFusedExperts)
    n = f"model.layers.{layers[0]}.mlp.experts"
    assert type(model.get_submodule(n)) is type(hf.get_submodule(n))
    assert model.get_submodule(n).gate_up_proj is params[f"{n}.gate_up_proj"]


def _reference_experts(gu, dn, act_fn, x, top_k_index, top_k_weights, r: LinearRecipe):
    """By hand: per expert, its inputs and its weights fake-quantized per the recipe's fprop specs, FP32 GEMMs,
    outputs in x's dtype, weighted and summed per token in FP32 (experts in ascending order)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(gu.shape[0]):
        tok, slot = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        order = torch.argsort(slot * x.shape[0] + tok)  # the eager loop's order: by top-k rank, then token
        tok, slot = tok[order], slot[order]
        xq = bs.fake_quantize(x[tok], r.fprop_input, dtype=torch.float32)
        h = (xq @ bs.fake_quantize(gu[e], r.fprop_weight, dtype=torch.float32).t()).to(x.dtype)
        h = act_fn(h[:, :I]) * h[:, I:]
        hq = bs.fake_quantize(h, r.fprop_input, dtype=torch.float32)
        y = (hq @ bs.fake_quantize(dn[e], r.fprop_weight, dtype=torch.float32).t()).to(x.dtype)
        out.index_add_(0, tok, top_k_weights[tok, slot, None].float() * y.float())
    return out.to(x.dtype)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_convert_nvfp4_equals_a_by_hand_per_expert_reference(family):
    model = tiny_moe(family, top_k=2)
    recipe = experts_only("nvfp4-nvidia")
    rep = bs.convert(model, recipe)
    assert rep.counts() == {"nvfp4-nvidia-experts": 2} and rep.experts == list(rep.converted)
    assert not any(isinstance(m, bs.QuantizedLinear) for m in model.modules())  # attention etc. as they are
    m = model.model.layers[1].mlp.experts
    assert isinstance(m, QuantizedFusedExperts) and m.recipe == bs.get_recipe("nvfp4-nvidia").linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, H, generator=g)
    top_k_index = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(24)])
    top_k_index[5] = torch.tensor([E, 1])  # transformers' "no expert" sentinel is skipped
    top_k_weights = torch.rand(24, 2, generator=g)
    with torch.no_grad():
        got = m(x, top_k_index, top_k_weights)
        want = _reference_experts(m.gate_up_proj, m.down_proj, m.act_fn, x, top_k_index, top_k_weights, m.recipe)
        assert torch.equal(got, want)
        # NVFP4 changed something (it is not the float forward), and the whole model runs
        hf = copy.deepcopy(model)
        bs.unconvert(hf)
        assert not torch.equal(got, hf.model.layers[1].mlp.experts(x, top_k_index, top_k_weights))
        assert torch.isfinite(logits(model, token_ids(2, 16))).all()


def test_convert_backward_and_an_optimizer_step_update_the_hf_parameters():
    model = tiny_moe("qwen2_moe").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made before convert: the Parameters stay the same
    gu0 = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    dn0 = model.model.layers[1].mlp.experts.down_proj.detach().clone()
    rep = bs.convert(model, "nvfp4-nvidia")
    assert len(rep.experts) == 2 and rep.counts()["nvfp4-nvidia"] > 2  # the shared expert's Linears too
    x = token_ids(4, 16)
    out = model(x, labels=x)
    out.loss.backward()
    for layer in model.model.layers:
        ex = layer.mlp.experts
        assert isinstance(ex, QuantizedFusedExperts)
        assert ex.gate_up_proj.grad is not None and ex.gate_up_proj.grad.abs().sum() > 0
        assert ex.down_proj.grad is not None and ex.down_proj.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns through the weights
    opt.step()
    assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj.detach(), gu0)
    assert not torch.equal(model.model.layers[1].mlp.experts.down_proj.detach(), dn0)
    # unconvert: the HF modules with the updated Parameters
    bs.unconvert(model)
    hf_ex = model.model.layers[0].mlp.experts
    assert type(hf_ex).__name__ == "Qwen2MoeExperts" and not torch.equal(hf_ex.gate_up_proj.detach(), gu0)


class _ExtraParameter(torch.nn.Module):  # the standard fused shapes plus a parameter the layout does not have
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = torch.nn.Parameter(torch.zeros(E, H, I))
        self.expert_scale = torch.nn.Parameter(torch.ones(E))
        self.act_fn, self.num_experts = torch.nn.SiLU(), E


class _Transposed(torch.nn.Module):  # gpt-oss-like ([E, H, 2I], biases) but not a GptOssExperts
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = torch.nn.Parameter(torch.zeros(E, I, H))


@pytest.mark.parametrize("cls,why", [(_ExtraParameter, "expert_scale"), (_Transposed, "gate_up_proj_bias")])
def test_experts_with_an_unsupported_layout_are_reported_and_left_alone(cls, why):
    model = torch.nn.Sequential()
    model.add_module("experts", cls())
    rep = bs.convert(model, "nvfp4-nvidia")
    assert isinstance(model.experts, cls) and not rep.converted and not rep.experts
    assert why in rep.unsupported["experts"] and "left as they are" in str(rep)
    with pytest.raises(ValueError, match=cls.__name__):
        QuantizedFusedExperts(model.experts)
    with pytest.raises(ValueError, match=cls.__name__):
        bs.nn.QuantizedGptOssExperts(model.experts)


def test_experts_only_rule_as_written_in_a_yaml_recipe(tmp_path):
    path = tmp_path / "nvfp4-experts.yaml"
    path.write_text("name: nvfp4-experts\nlinear:\n  fprop_input: {format: nvfp4}\n  fprop_weight: {format: nvfp4}\n"
                    "exclude: ['^(?!(.*\\.)?experts$)']\n")
    assert bs.get_recipe(path).exclude == (EXPERTS_ONLY_EXCLUDE,) == experts_only("bf16").exclude
    model = tiny_moe("qwen2_moe")  # shared experts (Linears), shared_expert_gate, attention: left as they are
    rep = bs.convert(model, path)
    assert rep.counts() == {"nvfp4-experts": 2} and rep.experts == ["model.layers.0.mlp.experts",
                                                                     "model.layers.1.mlp.experts"]
    assert "model.layers.0.mlp.shared_expert.gate_proj" in rep.excluded
    assert not any(isinstance(m, bs.QuantizedLinear) for m in model.modules())
