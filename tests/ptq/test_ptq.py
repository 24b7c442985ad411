"""Post-training quantization end to end: every method on a tiny random transformers Llama and on
stories260K; shared fused scales, export + reload bit for bit, GPTQ vs RTN, unrouted experts."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.capture import decoder_layers
from blockscale.quant.nvfp4 import input_encode_scale, outer_scale

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed=0, kv_heads=2, dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and a few outlier input channels, as real models have
        for layer in m.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.weight[:3] *= 8
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return m.to(dtype)


def calib(n=8, t=32, vocab=96, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@pytest.mark.parametrize("rule", ["6", "4over6", "sweep"])
def test_rtn_equals_quantize_with_the_group_scale(rule):
    model = tiny_llama()
    orig = copy.deepcopy(model)
    rep = quantize_model(model, PTQConfig(method="rtn", scale_rule=rule), progress=False)
    q = _linears(model)
    assert len(q) == 2 * 7 and len(rep.linears) == 14
    assert "lm_head" in rep.kept_high_precision and isinstance(model.lm_head, nn.Linear)
    spec = bs.NVFP4(scale_rule=rule)
    for i in range(2):
        for parent, members in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")),
                                ("self_attn", ("o_proj",)), ("mlp", ("down_proj",))):
            ws = [orig.get_submodule(f"model.layers.{i}.{parent}.{m}").weight for m in members]
            S = outer_scale(torch.stack([w.abs().max() for w in ws]).max(), spec.outer_bound)
            for name, w in zip(members, ws):
                lin = q[f"model.layers.{i}.{parent}.{name}"]
                ref = bs.quantize(w, spec, encode_scale=S)
                assert torch.equal(lin.weight_packed, ref.codes)
                assert torch.equal(lin.weight_scale.view(torch.uint8), ref.scales.view(torch.uint8))
                assert torch.equal(lin.weight_global_scale, S.reshape(1))  # one S per fused group
                assert torch.equal(lin.dequantized_weight(), ref.dequantize())
    assert torch.equal(model.model.embed_tokens.weight, orig.model.embed_tokens.weight)


METHOD_CASES = [
    dict(method="rtn"), dict(method="rtn", scale_rule="4over6", activations="w4a4", act_scale_rule="4over6"),
    dict(method="awq", options=AWQOptions(grid=5)),
    dict(method="awq", scale_rule="4over6", activations="w4a4", options=AWQOptions(grid=5)),
    dict(method="smoothquant", activations="w4a4"), dict(method="smoothquant", scale_rule="4over6"),
    dict(method="gptq"), dict(method="gptq", scale_rule="4over6", activations="w4a4"),
    dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="plain", act_order=True)),
    dict(method="gptq", scale_rule="sweep"),
]


def _case_id(fields: dict) -> str:
    """method-rule-...; the options that differ from their defaults as name=value."""
    out = []
    for k, v in fields.items():
        if k != "options":
            out.append(str(v))
            continue
        default = type(v)()
        out += [f"{f}={getattr(v, f)}" for f in v.__dataclass_fields__ if getattr(v, f) != getattr(default, f)]
    return "-".join(out)


@pytest.mark.parametrize("fields", METHOD_CASES, ids=_case_id)
def test_method_exports_and_reloads_bit_identical(fields, tmp_path):
    model = tiny_llama(kv_heads=4 if fields["method"] == "awq" else 2)  # AWQ also folds v -> o without GQA
    ref = copy.deepcopy(model)
    cfg = PTQConfig(n_samples=8, seq_len=32, batch_size=4, **fields)
    rep = quantize_model(model, cfg, calib(), progress=False)
    probe = calib(2, 24, seed=5)
    with torch.no_grad():
        logits = model(probe).logits
        fp_logits = ref(probe).logits
    rel = float((logits - fp_logits).norm() / fp_logits.norm())
    assert 0 < rel < 0.5, rel  # quantized, but still the same model
    if fields["method"] in ("awq", "smoothquant"):
        assert any(lr.smoothing_alpha is not None for lr in rep.linears)
    for lin in _linears(model).values():
        assert (lin.input_global_scale is not None) == (cfg.activations == "w4a4")
        assert torch.isfinite(lin.dequantized_weight()).all()
    for fmt in ("compressed-tensors", "modelopt"):
        out = bs.export_checkpoint(model, tmp_path / fmt, fmt)
        back = bs.load(out)
        assert bs.checkpoint_format(out) == fmt
        with torch.no_grad():
            assert torch.equal(back(probe).logits, logits), fmt


def test_smoothing_keeps_the_full_precision_function_before_quantization():
    """AWQ / SmoothQuant scales folded into norms and linears leave the fp32 model's logits unchanged."""
    from blockscale.ptq.methods.smoothquant import smoothquant_scales
    from blockscale.ptq.smoothing import find_smoothing_groups, fold_smoothing

    model = tiny_llama(kv_heads=4)
    probe = calib(2, 24, seed=3)
    with torch.no_grad():
        before = model(probe).logits
        g = torch.Generator().manual_seed(0)
        for layer in model.model.layers:
            for group in find_smoothing_groups(layer):
                amax = torch.rand(group.linears[0].in_features, generator=g) * 10
                fold_smoothing(group, smoothquant_scales(amax, [m.weight for m in group.linears], 0.5))
        after = model(probe).logits
    assert float((after - before).abs().max() / before.abs().max()) < 1e-5


def test_w4a4_input_scale_is_the_calibrated_amax_of_the_first_layer_inputs():
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = calib()
    seen = []
    h = ref.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].abs().max()))
    with torch.no_grad():
        for b in ids.split(4):
            ref(b)
    h.remove()
    quantize_model(model, PTQConfig(activations="w4a4", batch_size=4), ids, progress=False)
    lin = model.model.layers[0].self_attn
    S = input_encode_scale(float(torch.stack(seen).max()), "6")
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(lin, name).input_global_scale, S)


def test_gptq_never_increases_layer_output_error_over_rtn_stories260k(stories260k):
    from blockscale.data.text_sources import calibration_batches

    lm = stories260k
    ids = calibration_batches(lm.tokenizer, "tinystories#0.8:1", 16, 128, bos=True)
    for fields in (dict(scale_rule="6"), dict(scale_rule="4over6"), dict(scale_rule="sweep")):
        m = copy.deepcopy(lm.model)
        rep = quantize_model(m, PTQConfig(method="gptq", skip_indivisible=True, **fields), ids, progress=False)
        assert len(rep.linears) == 5 * 6  # down_proj (172 inputs) stays in high precision
        for lr in rep.linears:
            assert lr.output_rel_err <= lr.rtn_output_rel_err, (fields, lr)
        mean_ratio = sum(lr.output_rel_err / lr.rtn_output_rel_err for lr in rep.linears) / len(rep.linears)
        assert mean_ratio < 0.9, (fields, mean_ratio)


class _ToyMoEBlock(nn.Module):
    """Hard top-1 routing on the sign of one feature: experts 2 and 3 never see a token."""

    def __init__(self, d=32, n_experts=4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_experts))

    def forward(self, x):
        h = self.norm(x)
        route = (h[..., 0] > 0).long()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out[mask] = expert(h[mask])
        return x + out


class _ToyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_ToyMoEBlock() for _ in range(2))
        self.lm_head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def test_unrouted_experts_still_get_finite_scales():
    model = _ToyMoE()
    assert decoder_layers(model) is model.layers
    with pytest.warns(RuntimeWarning, match="no calibration tokens"):
        rep = quantize_model(model, PTQConfig(method="gptq", activations="w4a4", batch_size=4),
                             calib(8, 16, vocab=64), progress=False)
    by = {lr.name: lr for lr in rep.linears}
    for i in range(2):
        for e in range(4):
            lin = model.layers[i].experts[e]
            assert isinstance(lin, NVFP4Linear)
            assert torch.isfinite(lin.weight_global_scale).all() and float(lin.weight_global_scale) > 0
            assert torch.isfinite(lin.input_global_scale).all() and float(lin.input_global_scale) > 0
            assert torch.isfinite(lin.weight_scale.float()).all()
            assert (by[f"layers.{i}.experts.{e}"].tokens == 0) == (e >= 2)
    with torch.no_grad():
        assert torch.isfinite(model(calib(2, 16, vocab=64))).all()


def test_bad_input_errors():
    with pytest.raises(ValueError, match="method"):
        PTQConfig(method="hqq")
    with pytest.raises(ValueError, match="scale_rule"):
        PTQConfig(scale_rule="5")
    with pytest.raises(ValueError, match="activations"):
        PTQConfig(activations="w8a8")
    with pytest.raises(ValueError, match="exclude"):
        PTQConfig(exclude=("(",))
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_model(tiny_llama(), PTQConfig(method="gptq"), progress=False)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    odd = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        quantize_model(odd, PTQConfig(), progress=False)
    with pytest.raises(ValueError, match=r"81\.8% of the decoder layers' weight elements .*allow_partial=True"):
        quantize_model(odd, PTQConfig(skip_indivisible=True), progress=False)  # most of it would stay high precision
    rep = quantize_model(odd, PTQConfig(skip_indivisible=True, allow_partial=True), progress=False)
    assert len(rep.linears) == 1 and rep.linears[0].name.endswith("down_proj")  # the only 16-divisible input


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_bf16_model_quantizes_and_reloads_bit_identical(method, tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    # built in bf16 the way from_pretrained builds it (RoPE frequencies stay fp32)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    quantize_model(model, PTQConfig(method=method, scale_rule="4over6", activations="w4a4", n_samples=8, seq_len=32,
                                    batch_size=4, options=AWQOptions(grid=4) if method == "awq" else None),
                   calib(), progress=False)
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    probe = calib(2, 24, seed=7)
    with torch.no_grad():
        logits = model(probe).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    back = bs.load(bs.export_checkpoint(model, tmp_path / "ct", "compressed-tensors"))
    with torch.no_grad():
        assert torch.equal(back(probe).logits, logits)


def test_partly_excluded_fused_group_is_refused_before_calibration():
    with pytest.raises(ValueError, match="fused modules .*k_proj"):
        quantize_model(tiny_llama(), PTQConfig(method="gptq", exclude=(r"k_proj$",)), calib(), progress=False)
    rep = quantize_model(tiny_llama(), PTQConfig(exclude=(r"(q|k|v)_proj$",)), progress=False)
    assert len(rep.linears) == 2 * 4
