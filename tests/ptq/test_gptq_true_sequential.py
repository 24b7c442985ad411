"""GPTQ true sequential (GPTQOptions.true_sequential): equals a by-hand sequential reference built from the
library's primitives; off is the old path; MoE layers are refused before calibrating."""
from __future__ import annotations

import argparse

import pytest
import torch

from blockscale.cli.quantize import add_method_flags, method_options
from blockscale.errors import QuantizationError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.capture import capture_first_layer_inputs, run_layer
from blockscale.ptq.methods.gptq import dataflow_stages, gptq_quantize
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant.nvfp4 import shared_outer_scale

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

STAGES = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
          ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def _by_hand(model, ids, cfg):
    """The sequential reference: per layer and stage, Hessians from hooks while the layer (with the earlier
    stages already NVFP4Linear) runs on every batch, gptq_quantize with the group's shared outer scale."""
    spec = cfg.ptq_recipe.default.weight_spec
    layers = model.model.layers
    inputs = capture_first_layer_inputs(model, layers, list(ids.split(cfg.batch_size)))
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for stage in STAGES:
                mods = {n: layer.get_submodule(n) for n in stage}
                acc = {n: HessianAccumulator(m.in_features) for n, m in mods.items()}
                hooks = [m.register_forward_hook(lambda mod, a, o, n=n: acc[n].add(a[0].reshape(-1, a[0].shape[-1])
                                                                                   .float()))
                         for n, m in mods.items()]
                run_layer(layer, inputs, "cpu", keep_outputs=False)
                for h in hooks:
                    h.remove()
                S = shared_outer_scale([m.weight for m in mods.values()], spec.outer_bound)
                for n, m in mods.items():
                    q, _ = gptq_quantize(m.weight.detach(), acc[n].H, spec, S, cfg.options)
                    out[f"model.layers.{i}.{n}"] = q
                    parent, _, child = n.rpartition(".")
                    setattr(layer.get_submodule(parent), child, NVFP4Linear.from_quantized(q, m.bias,
                                                                                            dtype=m.weight.dtype))
            inputs = run_layer(layer, inputs, "cpu")
    return out


def _codes(model):
    return {n: (m.weight_packed.clone(), m.weight_scale.view(torch.uint8).clone(), m.weight_global_scale.clone())
            for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@pytest.mark.parametrize("rule", ["6", "4over6"])
def test_true_sequential_equals_the_by_hand_sequential_reference(rule):
    ids = token_ids(8, 32)
    cfg = PTQConfig(method="gptq", scale_rule=rule, options=GPTQOptions(true_sequential=True), n_samples=8,
                    seq_len=32, batch_size=4)
    model = tiny_hf_llama()
    quantize_model(model, cfg, ids, progress=False)
    got = _codes(model)
    ref = _by_hand(tiny_hf_llama(), ids, cfg)
    assert set(got) == set(ref) and len(ref) == 14
    for n, q in ref.items():
        packed, scales, S = got[n]
        assert torch.equal(packed, q.codes), n
        assert torch.equal(scales, q.scales.view(torch.uint8)), n
        assert torch.equal(S, q.outer_scale.reshape(1)), n

    # and it is not the default path: o_proj's Hessian now comes from the quantized q/k/v
    plain = tiny_hf_llama()
    quantize_model(plain, PTQConfig(method="gptq", scale_rule=rule, n_samples=8, seq_len=32, batch_size=4), ids,
                   progress=False)
    old = _codes(plain)
    for n in got:
        same = torch.equal(old[n][0], got[n][0])
        assert same == n.endswith(("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                                   "layers.0.self_attn.v_proj")), n


def test_dataflow_stages_of_a_llama_layer():
    model = tiny_hf_llama()
    layers = model.model.layers
    inputs = capture_first_layer_inputs(model, layers, [token_ids(2, 16)])
    linears = {f"model.layers.0.{n}": m for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    # registered in another order: the stages still follow the calls
    shuffled = dict(reversed(list(linears.items())))
    want = [[f"model.layers.0.{n}" for n in s] for s in STAGES]
    assert dataflow_stages(layers[0], linears, inputs, "cpu") == want
    got = dataflow_stages(layers[0], shuffled, inputs, "cpu")
    assert [sorted(s) for s in got] == [sorted(s) for s in want]
    assert dataflow_stages(layers[0], linears, None, "cpu") == want  # no inputs: fused_groups order


def test_moe_layers_are_refused_before_calibrating():
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(QuantizationError, match=r"model\.layers\.0: GPTQOptions\.true_sequential does not support "
                                                r"MoE layers .*experts"):
        quantize_model(model, PTQConfig(method="gptq", options=GPTQOptions(true_sequential=True), n_samples=2,
                                        seq_len=16), token_ids(2, 16), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


def test_flag_and_default():
    assert GPTQOptions().true_sequential is False
    p = argparse.ArgumentParser()
    add_method_flags(p)
    assert method_options(p.parse_args(["--gptq-true-sequential"]), "gptq").true_sequential is True
    assert method_options(p.parse_args([]), "gptq") == GPTQOptions()
