"""AWQ auto-clip (AWQOptions.clip, ptq.methods.awq_clip): never increases a Linear's calibration output
error over round to nearest with the same outer scale, clips an outlier whose input is small, keeps the
fused group's shared outer scale, skips q / k, and is on by default except with a Hessian-aware scale rule or
no NVFP4 weight (AWQOptions.clip=None, resolved by PTQConfig); clip=False is the old AWQ."""
from __future__ import annotations

import argparse

import pytest
import torch

from blockscale.cli.quantize import add_method_flags, method_options
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, PTQConfig, quantize_model
from blockscale.ptq.methods import AWQ
from blockscale.ptq.methods.awq_clip import awq_clip_search, clip_ratios
from blockscale.ptq.scheme_quantize import input_quantizer, rtn_quantize
from blockscale.quant import NVFP4, fake_quantize
from blockscale.quant.nvfp4 import input_encode_scale, shared_outer_scale

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

# the library keeps a row's clipping when its FP32-product error (float64 sums) is lower; recomputed here
# in float64, two nearly equal errors may order the other way by FP32 product rounding (~1e-6 relative)
REL = 1e-5


def _row_err(x, xq, q, w):
    x, w, q = x.double(), w.double(), q.double()
    xq = x if xq is None else xq.double()
    return (xq @ q.T - x @ w.T).square().sum(0)


def _inputs(seed, t=256, k=64):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)  # correlated channels
    return (torch.randn(t, k, generator=g) @ mix) * torch.rand(k, generator=g).mul(3).add(0.1)


@pytest.mark.parametrize("rule", ["6", "4over6", pytest.param("sweep", marks=pytest.mark.slow)])  # sweep: ~1 min
@pytest.mark.parametrize("w4a4", [False, True])
def test_clip_never_increases_the_output_error_random(rule, w4a4):
    spec = NVFP4(scale_rule=rule)
    worse_total = 0
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        W = torch.randn(48, 64, generator=g) * torch.rand(48, 1, generator=g).add(0.2)
        W[torch.rand(W.shape, generator=g) < 0.02] *= 8  # a few outliers
        x = _inputs(seed)
        S = shared_outer_scale([W], spec.outer_bound)
        aq = None
        if w4a4:
            enc = input_encode_scale(float(x.abs().max()), "6")
            aq = lambda t: fake_quantize(t, NVFP4(), encode_scale=enc, check_finite=False)  # noqa: E731
        res = awq_clip_search(W, x, spec, S, act_quantizer=aq)
        assert res.error <= res.baseline_error
        q_clip = rtn_quantize(res.weight, spec, S).dequantize(torch.float32)
        q_rtn = rtn_quantize(W, spec, S).dequantize(torch.float32)
        xq = aq(x) if aq is not None else None
        e_clip, e_rtn = _row_err(x, xq, q_clip, W), _row_err(x, xq, q_rtn, W)
        assert bool((e_clip <= e_rtn * (1 + REL)).all())
        # rows left unclipped are RTN bit for bit; clipped rows only lower values' magnitudes
        unclipped = (res.ratios == 1).all(1)
        assert torch.equal(q_clip[unclipped], q_rtn[unclipped])
        assert bool((res.weight.abs() <= W.abs()).all())
        worse_total += float(e_clip.sum()) < float(e_rtn.sum())
        assert abs(res.baseline_error - float(e_rtn.sum()) / (x.shape[0] * W.shape[0])) <= REL * res.baseline_error
    assert worse_total == 3  # it helps on every one of these cases (so the test can fail)


def test_ratio_one_only_is_rtn_bit_for_bit():
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    res = awq_clip_search(W, _inputs(1), NVFP4(), shared_outer_scale([W]), max_shrink=0.0)
    assert res.candidates == (1.0,) and torch.equal(res.weight, W) and res.error == res.baseline_error
    assert clip_ratios(20, 0.5) == tuple(1 - i / 20 for i in range(10))


def test_an_outlier_on_a_quiet_input_is_clipped():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 32, generator=g) * 0.1
    W[1, 5] = 3.0  # one outlier in block 0 of row 1
    x = torch.randn(512, 32, generator=g)
    x[:, 5] *= 1e-3  # ... on a channel that carries almost nothing
    res = awq_clip_search(W, x, NVFP4(), shared_outer_scale([W]))
    assert float(res.ratios[1, 0]) < 1.0
    assert res.error < res.baseline_error
    assert float(res.weight[1, 5]) < 3.0 and torch.equal(res.weight[1, 16:], W[1, 16:])


class _Recording(AWQ):
    """The real AWQ, keeping what each quantize_weight call saw and returned."""

    calls: list = []

    def quantize_weight(self, weight, stats, spec, encode_scale):
        res = super().quantize_weight(weight, stats, spec, encode_scale)
        clip, aq = self._clip_input_quantizer(stats)
        type(self).calls.append((stats.name, weight.detach().clone(), stats.sample(), spec, encode_scale, res.q,
                                 clip, aq, stats.amax))
        return res


@pytest.mark.parametrize("activations", ["w4a16", "w4a4"])
def test_clip_never_increases_each_linears_error_tiny_llama(monkeypatch, activations):
    from blockscale.ptq import methods

    monkeypatch.setitem(methods.METHODS, "awq", _Recording)
    _Recording.calls = []
    model = tiny_hf_llama()
    cfg = PTQConfig(method="awq", scale_rule="4over6", activations=activations,
                    options=AWQOptions(grid=5, clip=True), n_samples=8, seq_len=32, batch_size=4)
    quantize_model(model, cfg, token_ids(8, 32), progress=False)
    calls = _Recording.calls
    assert len(calls) == 14
    helped = 0
    for name, w, x, spec, S, q, clip, aq, _ in calls:
        q_rtn = rtn_quantize(w, spec, S).dequantize(torch.float32)
        got = q.dequantize(torch.float32)
        xq = aq(x.float()) if aq is not None else None
        assert (aq is not None) == (clip and activations == "w4a4"), name
        e_clip, e_rtn = _row_err(x, xq, got, w).sum(), _row_err(x, xq, q_rtn, w).sum()
        assert float(e_clip) <= float(e_rtn) * (1 + REL), name
        if name.endswith(("q_proj", "k_proj")):  # skipped, as AutoAWQ does
            assert not clip and torch.equal(got, q_rtn), name
        else:
            assert clip, name
        helped += float(e_clip) < float(e_rtn)
    assert helped >= 6  # most of the 10 clipped Linears improve
    # the fused groups still share one outer scale (S from the smoothed, unclipped weights)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    for i in range(2):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "self_attn" if "q_proj" in group else "mlp"
            S = [mods[f"model.layers.{i}.{parent}.{n}"].weight_global_scale for n in group]
            assert all(torch.equal(s, S[0]) for s in S)
    by_name = {c[0]: c for c in calls}
    for i in range(2):
        ws = [by_name[f"model.layers.{i}.self_attn.{n}"][1] for n in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(by_name[f"model.layers.{i}.self_attn.v_proj"][4], shared_outer_scale(ws, 256.0))


def test_w4a4_clip_scores_the_quantized_inputs_the_layer_sees(monkeypatch):
    from blockscale.ptq import methods

    monkeypatch.setitem(methods.METHODS, "awq", _Recording)
    _Recording.calls = []
    cfg = PTQConfig(method="awq", activations="w4a4", options=AWQOptions(grid=5, clip=True), n_samples=4, seq_len=32)
    quantize_model(tiny_hf_llama(), cfg, token_ids(4, 32), progress=False)
    scheme = cfg.ptq_recipe.default
    n_clipped = 0
    for name, w, x, spec, S, q, clip, aq, amax in _Recording.calls:
        if not clip:
            continue
        n_clipped += 1
        # the inputs as the layer's NVFP4Linear quantizes them: its static scale from the calibrated amax
        assert torch.equal(aq(x), input_quantizer(scheme, amax)(x)), name
        assert not torch.equal(aq(x), x)
        want = awq_clip_search(w, x, spec, S, act_quantizer=aq)
        assert torch.equal(q.dequantize(torch.float32), rtn_quantize(want.weight, spec, S).dequantize(torch.float32))
    assert n_clipped == 10


def test_auto_by_default_and_flags():
    assert AWQOptions().clip is None
    p = argparse.ArgumentParser()
    add_method_flags(p)
    o = method_options(p.parse_args(["--awq-clip", "--awq-clip-grid", "10", "--awq-clip-max-shrink", "0.3"]), "awq")
    assert (o.clip, o.clip_grid, o.clip_max_shrink, o.clip_qk) == (True, 10, 0.3, False)
    assert method_options(p.parse_args([]), "awq") == AWQOptions()
    assert method_options(p.parse_args(["--no-awq-clip"]), "awq").clip is False
    with pytest.raises(ValueError, match=r"AWQOptions.clip='yes': expected True or False or None \(auto\)"):
        AWQOptions(clip="yes")


@pytest.mark.parametrize("kw, want", [
    (dict(), True), (dict(scale_rule="4over6", activations="w4a4"), True), (dict(scale_rule="sweep"), True),
    (dict(scale_rule="hessian"), False), (dict(scale_rule="hessian-4over6"), False),
    (dict(recipe="nvfp4-experts-fp8-attention"), True),  # NVFP4 experts / MLPs: clipped; FP8 attention: not
    (dict(recipe="fp8"), False), (dict(recipe="mxfp4-w4a16"), False),  # no NVFP4 weight to clip
])
def test_auto_clip_resolves_from_the_recipe(kw, want):
    cfg = PTQConfig(method="awq", **kw)
    assert cfg.options.clip is want
    assert cfg.make_method().clip is want  # (through HessianScales' attribute forwarding for the Hessian rules)
    for explicit in (True, False):
        if explicit and "hessian" in kw.get("scale_rule", ""):
            continue  # refused (test_hessian_scales)
        assert PTQConfig(method="awq", options=AWQOptions(clip=explicit), **kw).options.clip is explicit
    assert AWQ().clip is True and AWQ(AWQOptions(clip=False)).clip is False  # a bare method: None is on


def test_default_awq_is_awq_with_clip_on_bit_for_bit():
    ids = token_ids(8, 32)
    a, b = tiny_hf_llama(), tiny_hf_llama()
    kw = dict(method="awq", scale_rule="4over6", n_samples=8, seq_len=32)
    quantize_model(a, PTQConfig(**kw, options=AWQOptions(grid=5)), ids, progress=False)
    quantize_model(b, PTQConfig(**kw, options=AWQOptions(grid=5, clip=True)), ids, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_clip_off_is_the_old_awq_bit_for_bit():
    ids = token_ids(8, 32)
    a, b = tiny_hf_llama(), tiny_hf_llama()
    kw = dict(method="awq", scale_rule="4over6", n_samples=8, seq_len=32)
    quantize_model(a, PTQConfig(**kw, options=AWQOptions(grid=5, clip=False)), ids, progress=False)
    quantize_model(b, PTQConfig(**kw, options=AWQOptions(grid=5, clip=False, clip_grid=3, clip_max_shrink=0.2,
                                                         clip_qk=True)), ids, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = tiny_hf_llama()
    quantize_model(c, PTQConfig(**kw, options=AWQOptions(grid=5, clip=True)), ids, progress=False)
    sc = c.state_dict()
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
