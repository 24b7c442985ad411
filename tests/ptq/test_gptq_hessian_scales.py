"""GPTQ with the Hessian-aware block-scale rules ("hessian", "hessian-4over6"): each group's scales are the rule's,
weighted by diag(H), chosen inside the GPTQ loop from the error-corrected weights.

A diagonal H propagates nothing, so the result is RTN with the rule (``quantize_weighted``) bit for bit, in every
column order; d = ones is GPTQ with the unweighted base rule bit for bit; in PTQ the first layer is the primitive
on its recorded Hessian, the model exports and reloads bit for bit, and the guard still refuses methods that pick
scales without weighing them."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale.errors import UsageError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.capture import capture_first_layer_inputs, run_layer
from blockscale.ptq.hessian_scales import HessianScales
from blockscale.ptq.methods.gptq import gptq_quantize
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant import NVFP4, quantize
from blockscale.quant.nvfp4 import outer_scale, shared_outer_scale
from blockscale.quant.nvfp4.weighted import WEIGHTED_RULES, quantize_weighted

pytestmark = pytest.mark.usefixtures("one_thread")

N, K, T = 40, 96, 256
RULES = ("hessian", "hessian-4over6")


def _weight(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, torch.randperm(K, generator=g)[:4]] *= 6.0  # a few large input channels
    w[3, 16:32] = 0.0  # a zero block
    return w


def _inputs(seed):
    g = torch.Generator().manual_seed(100 + seed)
    z = torch.randn(T, K, generator=g)
    x = z @ (torch.randn(K, K, generator=g) / K ** 0.5 + 0.5 * torch.eye(K))
    x[:, torch.randperm(K, generator=g)[:3]] *= 10.0  # outlier channels: d far from uniform
    return x


def _hessian(x):
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.H


def _same(a, b):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.outer_scale.reshape(()), b.outer_scale.reshape(()))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("order", ["default", "static", "act_order"])
def test_diagonal_hessian_is_rtn_with_the_rule_bit_for_bit(rule, order):
    w = _weight(1)
    g = torch.Generator().manual_seed(7)
    diag = torch.rand(K, generator=g) * 3 + 0.01
    diag[torch.randperm(K, generator=g)[:5]] *= 400.0  # heavy channels, in no particular order
    diag[11] = 0.0  # a dead input: its weights are zeroed, as GPTQ zeroes them
    H = torch.diag(diag)
    spec = WEIGHTED_RULES[rule]
    S = outer_scale(w.abs().amax(), spec.outer_bound)
    opts = GPTQOptions(static_groups=order == "static", act_order=order == "act_order")
    q, st = gptq_quantize(w, H, spec, S, opts, weighted_rule=rule)
    w0 = w.clone()
    w0[:, 11] = 0.0
    ref = quantize_weighted(w0, rule, S, diag)
    _same(q, ref)
    assert q.spec == spec and st["dead_columns"] == 1
    if rule == "hessian-4over6":  # the share of blocks at scale-to-4, counted from the stored scales
        s6, s4 = (quantize(w0, NVFP4(r), encode_scale=S).scales.float() for r in ("6", "4"))
        chose4 = (q.scales.float() == s4) & (s4 != s6)
        assert st["frac_scale4"] == pytest.approx(float(chose4.double().mean()), abs=1e-12)
        assert st["frac_scale4"] > 0.05
    # and the weights changed the choice: the unweighted base rule picks other scales somewhere
    base, _ = gptq_quantize(w, H, spec, S, opts)
    assert not torch.equal(base.scales.view(torch.uint8), q.scales.view(torch.uint8))


@pytest.mark.parametrize("rule, base_rule, opts", [("hessian", "sweep", GPTQOptions()),
                                                   ("hessian", "sweep", GPTQOptions(act_order=True)),
                                                   ("hessian-4over6", "4over6", GPTQOptions(four_over_six="plain"))])
def test_unit_channel_weights_are_gptq_with_the_base_rule(rule, base_rule, opts):
    """d = ones with a full (correlated) H: the same scales, codes and latent values as GPTQ with the unweighted
    rule, error feedback included."""
    w, H = _weight(2), _hessian(_inputs(2))
    spec = WEIGHTED_RULES[rule]
    assert spec.scale_rule == base_rule
    S = outer_scale(w.abs().amax(), spec.outer_bound)
    q, st = gptq_quantize(w, H, spec, S, opts, weighted_rule=rule, d=torch.ones(K))
    ref, st_ref = gptq_quantize(w, H, spec, S, opts)
    _same(q, ref)
    assert torch.equal(st["latent"], st_ref["latent"])
    assert st["frac_scale4"] == st_ref["frac_scale4"]


def test_weighted_rule_lowers_the_weighted_error_on_outlier_inputs():
    """With diag(H) as the weights, GPTQ's output error on the calibration inputs is below GPTQ with the plain
    sweep on these heavy-channel inputs (the choice of scales is what differs)."""
    w, x = _weight(3), _inputs(3)
    H = _hessian(x)
    spec = WEIGHTED_RULES["hessian"]
    S = outer_scale(w.abs().amax(), spec.outer_bound)
    q, _ = gptq_quantize(w, H, spec, S, GPTQOptions(), weighted_rule="hessian")
    p, _ = gptq_quantize(w, H, spec, S, GPTQOptions())

    def err(qt):
        return float(((w - qt.dequantize().float()) @ x.T).double().square().sum())

    assert err(q) < err(p)


def test_bad_arguments_are_refused():
    w, H = _weight(4), _hessian(_inputs(4))
    S = outer_scale(w.abs().amax(), 448.0)
    with pytest.raises(ValueError, match="weighted_rule='sweep'"):
        gptq_quantize(w, H, NVFP4("sweep"), S, weighted_rule="sweep")
    with pytest.raises(ValueError, match="stores its weights as 'sweep'"):
        gptq_quantize(w, H, NVFP4("6"), S, weighted_rule="hessian")
    with pytest.raises(ValueError, match=r"d has shape \(5,\)"):
        gptq_quantize(w, H, NVFP4("sweep"), S, weighted_rule="hessian", d=torch.ones(5))
    d = torch.ones(K)
    d[3] = float("nan")
    with pytest.raises(ValueError, match="d contains NaN"):
        gptq_quantize(w, H, NVFP4("sweep"), S, weighted_rule="hessian", d=d)


# ---------------------------------------------------------------------------------------------
# PTQ


transformers = pytest.importorskip("transformers")
from tiny_models import assert_reloads_bit_exact, tiny_hf_llama, token_ids  # noqa: E402


def _layer0_hessians(model, ids, batch_size):
    layer = model.model.layers[0]
    inputs = capture_first_layer_inputs(model, model.model.layers, list(ids.split(batch_size)))
    mods = {n: layer.get_submodule(n) for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
    acc = {n: HessianAccumulator(m.in_features) for n, m in mods.items()}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: acc[n].add(a[0].reshape(-1, a[0].shape[-1]).float()))
             for n, m in mods.items()]
    with torch.no_grad():
        run_layer(layer, inputs, "cpu", keep_outputs=False)
    for h in hooks:
        h.remove()
    return mods, {n: a.H for n, a in acc.items()}


@pytest.mark.parametrize("rule", RULES)
def test_ptq_gptq_hessian_layer0_is_the_primitive_and_reloads_bit_exact(rule, tmp_path):
    ids = token_ids(16, 32, seed=1)
    fp = tiny_hf_llama(seed=5)
    mods, Hs = _layer0_hessians(copy.deepcopy(fp), ids, 8)
    model = copy.deepcopy(fp)
    cfg = PTQConfig(method="gptq", scale_rule=rule, n_samples=16, seq_len=32, batch_size=8)
    report = quantize_model(model, cfg, ids, progress=False)
    assert all(r.scheme.startswith(f"nvfp4-w4a16 {rule}") for r in report.linears) and len(report.linears) == 14
    spec = WEIGHTED_RULES[rule]
    S = shared_outer_scale([m.weight for m in mods.values()], spec.outer_bound)
    for n, m in mods.items():
        ref, _ = gptq_quantize(m.weight.detach(), Hs[n], spec, S, GPTQOptions(), weighted_rule=rule)
        got = model.model.layers[0].get_submodule(n)
        assert isinstance(got, NVFP4Linear)
        assert torch.equal(got.weight_packed, ref.codes), n
        assert torch.equal(got.weight_scale.view(torch.uint8), ref.scales.view(torch.uint8)), n
    # not plain GPTQ with the base rule
    plain = copy.deepcopy(fp)
    quantize_model(plain, PTQConfig(method="gptq", scale_rule=spec.scale_rule, error="mse", n_samples=16, seq_len=32,
                                    batch_size=8), ids, progress=False)
    assert not torch.equal(plain.model.layers[0].self_attn.q_proj.weight_scale.view(torch.uint8),
                           model.model.layers[0].self_attn.q_proj.weight_scale.view(torch.uint8))
    assert_reloads_bit_exact(model, tmp_path / "ck")


@pytest.mark.parametrize("opts", [GPTQOptions(), GPTQOptions(true_sequential=True)])
def test_ptq_gptq_hessian_w4a4_and_true_sequential(opts):
    model = tiny_hf_llama(seed=6)
    cfg = PTQConfig(method="gptq", scale_rule="hessian", activations="w4a4", options=opts, n_samples=16, seq_len=32,
                    batch_size=8)
    report = quantize_model(model, cfg, token_ids(16, 32, seed=1), progress=False)
    assert len(report.linears) == 14 and all(r.weight_rel_mse < 0.05 for r in report.linears)
    with torch.no_grad():
        assert bool(torch.isfinite(model(token_ids(2, 16, seed=7)).logits).all())


def test_fused_moe_experts_take_the_rule_inside_gptq():
    from blockscale.nn import NVFP4Experts
    from tiny_moe import tiny_moe

    def run(rule):
        m = tiny_moe("mixtral")
        quantize_model(m, PTQConfig(method="gptq", scale_rule=rule, n_samples=16, seq_len=32, batch_size=8),
                       token_ids(16, 32, seed=1), progress=False)
        return [e for e in m.modules() if isinstance(e, NVFP4Experts)], m

    (eh, mh), (ep, _) = run("hessian"), run("sweep")
    assert len(eh) == 2 and len(ep) == 2
    assert any(not torch.equal(a.down_weight_scale.view(torch.uint8), b.down_weight_scale.view(torch.uint8))
               for a, b in zip(eh, ep))
    with torch.no_grad():
        assert bool(torch.isfinite(mh(token_ids(2, 16, seed=7)).logits).all())


def test_methods_that_choose_scales_without_weighing_them_are_still_refused():
    class Picks:  # a method that picks each group's block scales itself and cannot weigh them
        name = "picks"
        chooses_block_scales = True
        weighs_block_scales = False

        def check_scheme(self, name, scheme):
            pass

    scheme = PTQConfig(scale_rule="hessian").ptq_recipe.default
    with pytest.raises(UsageError, match="cannot be combined with method='picks'"):
        HessianScales(Picks()).check_scheme("model.layers.0.mlp.down_proj", scheme)
    HessianScales(PTQConfig(method="gptq").make_method()).check_scheme("x", scheme)  # GPTQ weighs them: accepted
