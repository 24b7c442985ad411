"""AWQ's smoothing, then GPTQ on the smoothed Linears (``AWQOptions(quantizer="gptq")``): the same smoothing scales
as AWQ without clip, each Linear GPTQ'd with the Hessian of its smoothed inputs (recorded again after folding),
Hessian-aware scale rules inside GPTQ's loop, auto-clip refused, export and reload bit for bit."""
from __future__ import annotations

import argparse

import pytest
import torch

from blockscale.cli.quantize import add_method_flags, method_options
from blockscale.errors import UsageError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.methods import AWQ
from blockscale.ptq.methods.gptq import gptq_quantize
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant.nvfp4.weighted import WEIGHTED_RULES

pytest.importorskip("transformers")
from tiny_models import assert_reloads_bit_exact, tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class _Recording(AWQ):
    calls: list = []

    def quantize_weight(self, weight, stats, spec, encode_scale):
        res = super().quantize_weight(weight, stats, spec, encode_scale)
        type(self).calls.append((stats.name, weight.detach().clone(), stats, spec, encode_scale, res.q, None))
        return res

    def quantize_weight_weighted(self, weight, stats, spec, encode_scale, rule):
        res = super().quantize_weight_weighted(weight, stats, spec, encode_scale, rule)
        type(self).calls.append((stats.name, weight.detach().clone(), stats, spec, encode_scale, res.q, rule))
        return res


def _cfg(rule="6", activations="w4a16", **kw):
    return PTQConfig(method="awq", scale_rule=rule, activations=activations,
                     options=AWQOptions(grid=5, **kw), n_samples=8, seq_len=32, batch_size=4)



@pytest.mark.parametrize("rule, activations", [("6", "w4a16"), ("hessian", "w4a16"), ("6", "w4a4")])

def test_each_linear_is_gptq_on_its_smoothed_inputs(monkeypatch, rule, activations):
    from blockscale.ptq import methods

    monkeypatch.setitem(methods.METHODS, "awq", _Recording)
    _Recording.calls = []
    ids = token_ids(8, 32)
    model = tiny_hf_llama()
    quantize_model(model, _cfg(rule, activations, quantizer="gptq"), ids, progress=False)
    calls = _Recording.calls
    assert len(calls) == 14 and all(c[6] == (None if rule == "6" else rule) for c in calls)
    opts = GPTQOptions()
    for name, w, stats, spec, S, q, weighted in calls:
        # the Hessian is of the inputs the smoothed Linear sees (all 256 calibration rows are in the sample)
        x = stats.sample()
        assert x.shape[0] == 8 * 32
        acc = HessianAccumulator(x.shape[-1])
        acc.add(x.float())
        assert torch.allclose(stats.H, acc.H, rtol=1e-4, atol=1e-6 * float(acc.H.abs().max())), name
        ref, _ = gptq_quantize(w, stats.H, spec, S, opts, weighted_rule=weighted)
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    # the smoothing is AWQ's (no clip): layer 0 (the same inputs) gets the same smoothed weights; later layers see
    # the outputs of differently quantized layers
    plain = tiny_hf_llama()
    _Recording.calls = []
    base = WEIGHTED_RULES[rule].scale_rule if rule in WEIGHTED_RULES else rule  # AWQ searches with the base rule
    quantize_model(plain, _cfg(base, activations, quantizer="rtn", clip=False), ids, progress=False)
    smoothed = {c[0]: c[1] for c in _Recording.calls}
    assert set(smoothed) == {c[0] for c in calls}
    layer0 = [c for c in calls if c[0].startswith("model.layers.0.")]
    assert len(layer0) == 7 and all(torch.equal(smoothed[c[0]], c[1]) for c in layer0)
    assert any(not torch.equal(a.weight_packed, b.weight_packed)
               for a, b in zip(model.modules(), plain.modules()) if isinstance(a, NVFP4Linear))


def test_awq_gptq_exports_and_reloads_bit_for_bit(tmp_path):
    model = tiny_hf_llama(seed=3)
    quantize_model(model, _cfg("hessian", quantizer="gptq"), token_ids(8, 32, seed=2), progress=False)
    assert_reloads_bit_exact(model, tmp_path / "ck")


def test_options_and_flags():
    assert PTQConfig(method="awq", options=AWQOptions(quantizer="gptq")).options.clip is False  # auto: off
    assert PTQConfig(method="awq").options.clip is True  # RTN: auto-clip on, as before
    with pytest.raises(UsageError, match="clip"):
        AWQOptions(quantizer="gptq", clip=True)
    with pytest.raises(UsageError, match="quantizer"):
        AWQOptions(quantizer="autoround")
    p = argparse.ArgumentParser()
    add_method_flags(p)
    args = p.parse_args(["--awq-quantizer", "gptq"])
    assert method_options(args, "awq") == AWQOptions(quantizer="gptq")


def test_awq_search_with_the_sweep_uses_its_exact_fast_path():
    """AWQ's grid search quantizes with the scheme's base rule; for the sweep (base of "hessian") that is now
    ``rtn_quantize``'s fast sweep: bit for bit the reference ``fake_quantize`` values."""
    from blockscale.ptq.methods.awq_error import scheme_quantizers
    from blockscale.quant import fake_quantize
    from blockscale.quant.nvfp4 import shared_outer_scale

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(24, 64, generator=g) * torch.rand(64, generator=g).mul(4).add(0.01) for _ in range(3)]
    ws[1][2, :16] = 0.0
    ws[2][5, 16:32] = 1e-6
    spec = WEIGHTED_RULES["hessian"]
    qw, _ = scheme_quantizers(None, spec, None)
    S = shared_outer_scale(ws, spec.outer_bound)
    for got, w in zip(qw(ws), ws):
        assert torch.equal(got, fake_quantize(w, spec, encode_scale=S, dtype=torch.float32))
