"""GPTQ on the rounded inputs' Hessians (GPTQOptions.rounded_inputs, AWQOptions.rounded_inputs): W4A4 equals a by-hand
reference built from the library's primitives (each Linear's Hessian from its inputs NVFP4-rounded at its fused
group's calibrated input scale); W4A16 is unchanged, with a note; the options and their flags."""
from __future__ import annotations

import argparse

import pytest
import torch

from blockscale.cli.quantize import add_method_flags, method_options
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.capture import capture_first_layer_inputs, run_layer
from blockscale.ptq.methods.gptq import gptq_quantize
from blockscale.ptq.options import OptionError
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant import NVFP4, fake_quantize
from blockscale.quant.nvfp4 import input_encode_scale, shared_outer_scale

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
          ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def _record(layer, inputs, names, rounding=None):
    """{name: (amax, HessianAccumulator)} of the Linears' inputs (rounded by ``rounding[name]`` where given)."""
    mods = {n: layer.get_submodule(n) for n in names}
    acc = {n: [0.0, HessianAccumulator(m.in_features)] for n, m in mods.items()}

    def hook(mod, a, o, n):
        x = a[0].reshape(-1, a[0].shape[-1]).float()
        acc[n][0] = max(acc[n][0], float(x.abs().max()))
        acc[n][1].add(rounding[n](x) if rounding else x)

    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: hook(mod, a, o, n)) for n, m in mods.items()]
    run_layer(layer, inputs, "cpu", keep_outputs=False)
    for h in hooks:
        h.remove()
    return acc


def _by_hand(model, ids, cfg, rule):
    """Per layer: the inputs' amaxes, then each group's inputs rounded as its W4A4 NVFP4Linear will (input scale
    from the group's amax) for the Hessians, gptq_quantize with the group's shared weight scale."""
    spec = cfg.ptq_recipe.default.weight_spec
    act = NVFP4(scale_rule=rule, error="mse")
    layers = model.model.layers
    inputs = capture_first_layer_inputs(model, layers, list(ids.split(cfg.batch_size)))
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(layers):
            names = [n for g in GROUPS for n in g]
            first = _record(layer, inputs, names)
            enc = {n: input_encode_scale(max(first[m][0] for m in g), rule) for g in GROUPS for n in g}
            rounding = {n: (lambda x, e=enc[n]: fake_quantize(x, act, encode_scale=e, check_finite=False))
                        for n in names}
            second = _record(layer, inputs, names, rounding)
            for g in GROUPS:
                mods = {n: layer.get_submodule(n) for n in g}
                S = shared_outer_scale([m.weight for m in mods.values()], spec.outer_bound)
                for n, m in mods.items():
                    q, _ = gptq_quantize(m.weight.detach(), second[n][1].H, spec, S, cfg.options)
                    out[f"model.layers.{i}.{n}"] = (q, enc[n])
                    parent, _, child = n.rpartition(".")
                    setattr(layer.get_submodule(parent), child, NVFP4Linear.from_quantized(
                        q, m.bias, input_global_scale=enc[n], input_scale_rule=rule, dtype=m.weight.dtype))
            inputs = run_layer(layer, inputs, "cpu")
    return out


def _codes(model):
    return {n: (m.weight_packed.clone(), m.weight_scale.view(torch.uint8).clone(), m.weight_global_scale.clone(),
                None if m.input_global_scale is None else m.input_global_scale.clone())
            for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@pytest.mark.parametrize("rule", ["6", "4over6"])
def test_w4a4_equals_the_by_hand_rounded_input_reference(rule):
    ids = token_ids(8, 32)
    cfg = PTQConfig(method="gptq", activations="w4a4", act_scale_rule=rule, options=GPTQOptions(rounded_inputs=True),
                    n_samples=8, seq_len=32, batch_size=4)
    model = tiny_hf_llama()
    quantize_model(model, cfg, ids, progress=False)
    got = _codes(model)
    ref = _by_hand(tiny_hf_llama(), ids, cfg, rule)
    assert set(got) == set(ref) and len(ref) == 14
    for n, (q, enc) in ref.items():
        packed, scales, S, in_S = got[n]
        assert torch.equal(packed, q.codes), n
        assert torch.equal(scales, q.scales.view(torch.uint8)), n
        assert torch.equal(S, q.outer_scale.reshape(1)), n
        assert torch.equal(in_S, enc.reshape(1)), n

    # not the default path: the rounded Hessians give other codes
    plain = tiny_hf_llama()
    quantize_model(plain, PTQConfig(method="gptq", activations="w4a4", act_scale_rule=rule, n_samples=8, seq_len=32,
                                    batch_size=4), ids, progress=False)
    old = _codes(plain)
    assert any(not torch.equal(old[n][0], got[n][0]) for n in got)


def test_w4a16_is_unchanged_with_a_note():
    ids = token_ids(4, 32)
    kw = dict(method="gptq", n_samples=4, seq_len=32, batch_size=4)
    a, b = tiny_hf_llama(), tiny_hf_llama()
    with pytest.warns(RuntimeWarning, match="rounded-input Hessians: no Linear"):
        rep = quantize_model(a, PTQConfig(**kw, options=GPTQOptions(rounded_inputs=True)), ids, progress=False)
    quantize_model(b, PTQConfig(**kw), ids, progress=False)
    ca, cb = _codes(a), _codes(b)
    assert all(torch.equal(ca[n][0], cb[n][0]) and torch.equal(ca[n][1], cb[n][1]) for n in cb)
    assert sum("rounded-input Hessians: no Linear" in w for w in rep.warnings) == 1


def test_awq_with_gptq_takes_the_option():
    ids = token_ids(4, 32)
    kw = dict(method="awq", activations="w4a4", n_samples=4, seq_len=32, batch_size=4)
    a, b = tiny_hf_llama(), tiny_hf_llama()
    quantize_model(a, PTQConfig(**kw, options=AWQOptions(quantizer="gptq", rounded_inputs=True)), ids, progress=False)
    quantize_model(b, PTQConfig(**kw, options=AWQOptions(quantizer="gptq")), ids, progress=False)
    ca, cb = _codes(a), _codes(b)
    assert any(not torch.equal(ca[n][0], cb[n][0]) for n in cb)
    # the input scales stay the unrounded inputs' amax: equal where the inputs are (the first layer)
    assert all(torch.equal(ca[n][3], cb[n][3]) for n in cb if n.startswith("model.layers.0."))


def test_options_and_flags():
    assert GPTQOptions().rounded_inputs is False and AWQOptions().rounded_inputs is False
    with pytest.raises(OptionError, match="rounded_inputs.*true_sequential"):
        GPTQOptions(rounded_inputs=True, true_sequential=True)
    with pytest.raises(OptionError, match="rounded_inputs.*quantizer='gptq'"):
        AWQOptions(rounded_inputs=True)
    p = argparse.ArgumentParser()
    add_method_flags(p)
    assert method_options(p.parse_args(["--gptq-rounded-inputs"]), "gptq") == GPTQOptions(rounded_inputs=True)
    assert method_options(p.parse_args(["--awq-quantizer", "gptq", "--awq-rounded-inputs"]), "awq") == AWQOptions(
        quantizer="gptq", rounded_inputs=True)
