"""PTQ of fused 3-D MoE experts (transformers >= 5 Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE): every expert's
NVFP4 weights with its own outer scale (gate and up of one expert share it), NVFP4Experts' forward equal to
the transformers module holding the dequantized weights, W4A4 input scales from the tokens routed to each
expert, unrouted experts with finite scales and a note, coverage, clear refusals."""
from __future__ import annotations

import copy

import pytest
import torch

import blockscale as bs
from blockscale.errors import QuantizationError
from blockscale.nn import NVFP4Experts, NVFP4Linear
from blockscale.nn.coverage import weight_coverage
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.quant.nvfp4 import input_encode_scale, outer_scale
from blockscale.recipes.recipe import DEFAULT_EXCLUDE

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, H, I, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]


def _experts(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Experts")}


def _dequantized_reference(float_model, quantized):
    """float_model with every quantized module's weights replaced by the dequantized ones (in place)."""
    mods = dict(quantized.named_modules())
    with torch.no_grad():
        for n, m in float_model.named_modules():
            q = mods.get(n)
            if isinstance(q, NVFP4Linear):
                m.weight.copy_(q.dequantized_weight(m.weight.dtype))
            elif isinstance(q, NVFP4Experts):
                gu, dn = q.dequantized(m.gate_up_proj.dtype)
                m.gate_up_proj.copy_(gu)
                m.down_proj.copy_(dn)
    return float_model


# the sweep (126 scales per block) costs ~15 s per model on 2 cores: one family covers its per-expert path
@pytest.mark.parametrize("family,rule", [(f, r) for r in ("6", "4over6") for f in FAMILIES] + [("qwen3_moe", "sweep")])
def test_each_expert_has_its_own_outer_scale_and_logits_match(family, rule):
    model = tiny_moe(family)
    ref = copy.deepcopy(model)
    float_experts = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
                     for n, m in _experts(model).items()}
    assert len(float_experts) == 2
    rep = quantize_model(model, PTQConfig(scale_rule=rule), progress=False)
    spec = bs.NVFP4(scale_rule=rule)
    for name, (gu, dn) in float_experts.items():
        q = model.get_submodule(name)
        assert isinstance(q, NVFP4Experts) and q.scheme_name == "nvfp4-w4a16"
        for e in range(E):
            # independent: gate and up of expert e share S = bound*6 / max(amax(gate_e), amax(up_e))
            amax = torch.maximum(gu[e, :I].abs().max(), gu[e, I:].abs().max())
            S = outer_scale(amax, spec.outer_bound)
            want = bs.quantize(gu[e], spec, encode_scale=S)
            assert torch.equal(q.gate_up_weight_packed[e], want.codes)
            assert torch.equal(q.gate_up_weight_scale[e].view(torch.uint8), want.scales.view(torch.uint8))
            assert torch.equal(q.gate_up_weight_global_scale[e], S)
            S = outer_scale(dn[e].abs().max(), spec.outer_bound)
            want = bs.quantize(dn[e], spec, encode_scale=S)
            assert torch.equal(q.down_weight_packed[e], want.codes)
            assert torch.equal(q.down_weight_scale[e].view(torch.uint8), want.scales.view(torch.uint8))
            assert torch.equal(q.down_weight_global_scale[e], S)
        assert len(set(q.gate_up_weight_global_scale.tolist())) == E  # one per expert, not per tensor
    assert [r.name for r in rep.experts] == list(float_experts)
    assert all(r.tokens is None and len(r.weight_rel_mse["gate_up"]) == E for r in rep.experts)
    _dequantized_reference(ref, model)
    ids = token_ids(2, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # the model's own experts implementation
        model.set_experts_implementation("eager")
        ref.set_experts_implementation("eager")
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_bfloat16_model_logits_match_and_survive_deepcopy():
    model = tiny_moe("mixtral").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    quantize_model(model, PTQConfig(), progress=False)
    assert model.model.layers[0].mlp.experts.dequantized()[0].dtype == torch.bfloat16
    _dequantized_reference(ref, model)
    ids = token_ids(2, 16)
    with torch.no_grad():
        out = model(ids).logits
        assert torch.equal(out, ref(ids).logits)
        assert torch.equal(copy.deepcopy(model)(ids).logits, out)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_coverage_counts_experts_as_quantized(family):
    model = tiny_moe(family)
    rep = quantize_model(model, PTQConfig(), progress=False)
    cov = weight_coverage(model.model.layers, "model.layers")
    for i in range(2):
        assert cov.quantized[f"model.layers.{i}.mlp.experts"] == 3 * E * I * H
        assert f"model.layers.{i}.mlp.experts" not in rep.kept_high_precision
    assert set(cov.high_precision) == {f"model.layers.{i}.mlp.gate" for i in range(2)}  # routers stay
    assert cov.high_precision == rep.high_precision_elements
    assert cov.high_precision_fraction == pytest.approx(rep.high_precision_fraction, rel=1e-12)


def _routed_inputs(float_model, quantized, i, calibration, batch_size):
    """Per expert of layer i: the hidden states routed to it, from a model whose layers < i are the
    quantized ones (what calibration feeds layer i), and its full-precision act(gate) * up."""
    hybrid = copy.deepcopy(float_model).requires_grad_(False)
    for j in range(i):
        hybrid.model.layers[j] = copy.deepcopy(quantized.model.layers[j])
    seen = []
    experts = hybrid.model.layers[i].mlp.experts
    h = experts.register_forward_pre_hook(lambda mod, args: seen.append((args[0].clone(), args[1].clone())))
    with torch.no_grad():
        for ids in calibration.split(batch_size):
            hybrid(input_ids=ids, use_cache=False)
    h.remove()
    xs, mids = [[] for _ in range(E)], [[] for _ in range(E)]
    for x, idx in seen:
        for e in range(E):
            rows = (idx == e).any(-1)
            xe = x[rows]
            xs[e].append(xe)
            w1, w3 = experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:]
            mids[e].append(torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T))
    return [torch.cat(v) for v in xs], [torch.cat(v) for v in mids]


def test_w4a4_input_scales_come_from_the_tokens_routed_to_each_expert():
    model = tiny_moe("mixtral")
    ref = copy.deepcopy(model)
    calib = token_ids(4, 16)
    cfg = PTQConfig(activations="w4a4", batch_size=2)
    rep = quantize_model(model, cfg, calib, progress=False)
    for i in range(2):
        q = model.model.layers[i].mlp.experts
        assert q.scheme_name == "nvfp4-w4a4"
        xs, mids = _routed_inputs(ref, model, i, calib, 2)
        r = rep.experts[i]
        assert r.tokens == [x.shape[0] for x in xs] and sum(r.tokens) == calib.numel() * 2
        for e in range(E):
            amax = float(xs[e].abs().max())
            assert r.input_amax["gate_up"][e] == amax
            assert torch.equal(q.gate_up_input_global_scale[e:e + 1], input_encode_scale(amax))
            assert r.input_amax["down"][e] == pytest.approx(float(mids[e].abs().max()), rel=1e-5)
            assert torch.equal(q.down_input_global_scale[e:e + 1], input_encode_scale(r.input_amax["down"][e]))
        # not the layer-wide amax: each expert's own
        assert len(set(r.input_amax["gate_up"])) > 1


def test_w4a4_forward_quantizes_each_experts_inputs_with_its_scale():
    model = tiny_moe("mixtral")
    ref = copy.deepcopy(model)
    quantize_model(model, PTQConfig(activations="w4a4"), token_ids(4, 16), progress=False)
    q = model.model.layers[0].mlp.experts
    torch.manual_seed(1)
    x = torch.randn(10, H)
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(10)])
    w = torch.rand(10, 2)
    gu, dn = q.dequantized()
    spec = bs.NVFP4()
    want = torch.zeros_like(x)
    for t in range(10):
        for k in range(2):
            e = int(idx[t, k])
            xt = bs.fake_quantize(x[t:t + 1], spec, encode_scale=q.gate_up_input_global_scale[e])
            g, u = (xt @ gu[e].T).chunk(2, dim=-1)
            mid = bs.fake_quantize(torch.nn.functional.silu(g) * u, spec, encode_scale=q.down_input_global_scale[e])
            want[t] += (mid @ dn[e].T)[0] * w[t, k]
    with torch.no_grad():
        got = q(x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # with the input quantizers off it is the transformers module on the dequantized weights
    ref_experts = ref.model.layers[0].mlp.experts
    with torch.no_grad():
        ref_experts.gate_up_proj.copy_(gu)
        ref_experts.down_proj.copy_(dn)
        ref.set_experts_implementation("eager")
        assert torch.equal(q._eager(x, idx, w, gu, dn, quantize_input=lambda x, proj, e: x), ref_experts(x, idx, w))


def test_unrouted_expert_gets_finite_scales_and_a_note():
    model = tiny_moe("mixtral", top_k=1)
    with torch.no_grad():  # top-1 routing never picks expert 3: max(v.h, -v.h) >= 0 = its logit
        for layer in model.model.layers:
            g = layer.mlp.gate.weight
            g[1] = -g[0]
            g[3] = 0
    with pytest.warns(RuntimeWarning, match="no calibration tokens routed to expert"):
        rep = quantize_model(model, PTQConfig(activations="w4a4"), token_ids(4, 16), progress=False)
    for i, r in enumerate(rep.experts):
        assert r.tokens[3] == 0 and sum(r.tokens) == 64
        assert "expert(s) [3]" in r.note
        assert any(w.startswith(f"model.layers.{i}.mlp.experts: no calibration tokens") for w in rep.warnings)
        q = model.model.layers[i].mlp.experts
        for b in (q.gate_up_input_global_scale, q.down_input_global_scale, q.gate_up_weight_global_scale):
            assert torch.isfinite(b).all() and (b > 0).all()
        assert r.input_amax["gate_up"][3] == max(r.input_amax["gate_up"][:3])
        assert torch.isfinite(q.dequantized()[0]).all()
    with torch.no_grad():
        assert torch.isfinite(model(token_ids(2, 16)).logits).all()


def test_other_methods_and_schemes_are_refused_before_calibration(monkeypatch):
    import importlib

    from blockscale.ptq.methods import GPTQ

    qm = importlib.import_module("blockscale.ptq.quantize_model")
    monkeypatch.setattr(qm, "capture_first_layer_inputs", lambda *a, **k: pytest.fail("calibration ran"))
    # a method that cannot quantize fused experts (every built-in one can): GPTQ without the flag
    monkeypatch.setattr(GPTQ, "quantizes_fused_experts", False)
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.mlp\.experts: method='gptq' is not yet "
                                                r"supported for fused experts \(2 fused-experts modules\)"):
        quantize_model(tiny_moe("qwen3_moe"), PTQConfig(method="gptq"), token_ids(4, 16), progress=False)
    # FP8 / MX schemes on fused experts are supported (SchemeExperts; tests/nn/test_moe_scheme_experts.py)
    monkeypatch.undo()
    model = tiny_moe("mixtral")
    quantize_model(model, PTQConfig(recipe="fp8"), token_ids(4, 16), progress=False)
    assert all(type(layer.mlp.experts).__name__ == "SchemeExperts" for layer in model.model.layers)


def test_unknown_fused_layout_names_the_module():
    model = tiny_moe("mixtral")
    experts = model.model.layers[1].mlp.experts
    experts.register_parameter("gate_up_proj_bias", torch.nn.Parameter(torch.zeros(E, 2 * I)))
    with pytest.raises(QuantizationError, match=r"^model\.layers\.1\.mlp\.experts: MixtralExperts holds fused 3-D "
                                                r"expert parameters in a layout PTQ does not know"):
        quantize_model(model, PTQConfig(), progress=False)


def test_excluded_experts_stay_in_high_precision():
    model = tiny_moe("mixtral")
    rep = quantize_model(model, PTQConfig(exclude=DEFAULT_EXCLUDE + (r"experts$",), allow_partial=True),
                         progress=False)
    assert rep.experts == [] and "model.layers.0.mlp.experts" in rep.kept_high_precision
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


# export of quantized experts and the CLI's quantize -> export: tests/export/test_export_fused_experts.py
