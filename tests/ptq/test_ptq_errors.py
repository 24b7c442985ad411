"""PTQ reports honestly and fails clearly: parameters it does not quantize (fused 3-D MoE experts,
routers) are listed with their share of the decoder weights, a mostly high-precision model is refused
unless allow_partial; non-finite activations, non-finite weights, bad calibration ids name the layer."""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

from blockscale.errors import DataError, QuantizationError
from blockscale.nn import NVFP4Linear
from blockscale.nn.coverage import weight_coverage
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.recipes.recipe import DEFAULT_EXCLUDE

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
qm = importlib.import_module("blockscale.ptq.quantize_model")  # the module (the package exports the function)

# tiny Mixtral: per layer attention 64x64 + 32x64 + 32x64 + 64x64 = 12288 elements in Linears, router
# 4x64 = 256, fused experts gate_up [4, 256, 64] + down [4, 64, 128] = 98304
ATTN, ROUTER, EXPERTS = 12288, 256, 98304
MIX_FRACTION = (ROUTER + EXPERTS) / (ATTN + ROUTER + EXPERTS)
# PTQ quantizes fused experts (tests/ptq/test_ptq_fused_experts.py); excluded, they stay in high precision
NO_EXPERTS = DEFAULT_EXCLUDE + (r"experts$",)


def tiny_mixtral(seed: int = 0):
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).eval()


@pytest.fixture
def no_calibration_run(monkeypatch):
    """Fail the test if quantize_model starts running the model on calibration data."""
    def refuse(*_a, **_k):
        raise AssertionError("the model was run on calibration data before the error")

    monkeypatch.setattr(qm, "capture_first_layer_inputs", refuse)


def _n_quantized(model) -> int:
    return sum(isinstance(m, NVFP4Linear) for m in model.modules())


# ------------------------------------------------------------------------------------------------
# 1. what stays in high precision is reported; a mostly high-precision model is refused


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_mixtral_fused_experts_refused_before_calibration(method, no_calibration_run):
    model = tiny_mixtral()
    with pytest.raises(QuantizationError) as err:
        quantize_model(model, PTQConfig(method=method, exclude=NO_EXPERTS), token_ids(4, 16), progress=False)
    msg = str(err.value)
    assert f"{100 * MIX_FRACTION:.1f}%" in msg  # 88.9%
    assert "model.layers.0.mlp.experts" in msg and "4 modules" in msg
    assert "allow_partial=True" in msg
    assert _n_quantized(model) == 0  # nothing was changed


def test_mixtral_allow_partial_lists_experts_and_routers_with_one_warning():
    model = tiny_mixtral()
    with pytest.warns(RuntimeWarning) as rec:
        rep = quantize_model(model, PTQConfig(allow_partial=True, exclude=NO_EXPERTS), progress=False)
    lines = [str(w.message) for w in rec if "high precision" in str(w.message)]
    assert len(lines) == 1 and f"{100 * MIX_FRACTION:.1f}% of the decoder layers' weight elements" in lines[0]
    assert "model.layers.0.mlp.experts" in lines[0]
    assert _n_quantized(model) == 2 * 4  # the attention Linears
    for i in range(2):
        assert f"model.layers.{i}.mlp.experts" in rep.kept_high_precision
        assert f"model.layers.{i}.mlp.gate" in rep.kept_high_precision
        assert rep.high_precision_elements[f"model.layers.{i}.mlp.experts"] == EXPERTS
        assert rep.high_precision_elements[f"model.layers.{i}.mlp.gate"] == ROUTER
    assert "lm_head" in rep.kept_high_precision
    assert len(rep.high_precision_elements) == 4
    assert rep.high_precision_fraction == pytest.approx(MIX_FRACTION, rel=1e-12)
    after = weight_coverage(model.model.layers, "model.layers")  # what was done matches what is reported
    assert after.high_precision == rep.high_precision_elements
    assert after.high_precision_fraction == pytest.approx(rep.high_precision_fraction, rel=1e-12)
    assert rep.to_dict()["high_precision_fraction"] == rep.high_precision_fraction


def test_partly_excluded_llama_is_refused_unless_allow_partial(no_calibration_run):
    mlp = r"mlp\.(gate|up|down)_proj$"  # 3 x 8192 of 36 864 elements per layer: 66.7%
    with pytest.raises(QuantizationError, match=r"66\.7%.*6 modules.*allow_partial=True"):
        quantize_model(tiny_hf_llama(), PTQConfig(exclude=(mlp,)), progress=False)
    with pytest.warns(RuntimeWarning, match=r"66\.7% of the decoder layers' weight elements"):
        rep = quantize_model(tiny_hf_llama(), PTQConfig(exclude=(mlp,), allow_partial=True), progress=False)
    assert rep.high_precision_elements["model.layers.1.mlp.down_proj"] == 128 * 64


def test_tiny_llama_quantizes_silently():
    model = tiny_hf_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = quantize_model(model, PTQConfig(), progress=False)
    assert rep.kept_high_precision == ["lm_head"] and rep.warnings == []
    assert rep.high_precision_elements == {} and rep.high_precision_fraction == 0.0
    assert _n_quantized(model) == 14


def test_allow_partial_must_be_a_bool():
    with pytest.raises(ValueError, match="allow_partial"):
        PTQConfig(allow_partial="yes")
    assert PTQConfig().allow_partial is False and PTQConfig().to_dict()["allow_partial"] is False


# ------------------------------------------------------------------------------------------------
# 2. non-finite calibration activations: DataError naming the Linear and its decoder layer

ACT_CASES = [dict(method="rtn", activations="w4a4"), dict(method="gptq"), dict(method="awq"),
             dict(method="smoothquant", activations="w4a4"), dict(method="awq", activations="w4a4")]


def _overflow_after_layer_0(model, value):
    """Layer 0 outputs ``value`` at one position of one sequence (as an fp16 overflow would)."""
    def hook(_mod, _args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[1, 4, 5] = value
        return (h, *out[1:]) if isinstance(out, tuple) else h

    model.model.layers[0].register_forward_hook(hook)


@pytest.mark.parametrize("value, bad", [(float("nan"), 64), (float("inf"), 1)])  # RMSNorm(inf) = NaN in one channel
@pytest.mark.parametrize("fields", ACT_CASES, ids=lambda f: "-".join(f.values()))
def test_non_finite_activations_name_the_layer(fields, value, bad):
    model = tiny_hf_llama()
    _overflow_after_layer_0(model, value)  # the inputs of layer 1's q/k/v become non-finite
    with pytest.raises(DataError, match=r"^model\.layers\.1\.self_attn\.q_proj \(decoder layer 1\): its "
                                        rf"calibration inputs contain NaN/inf \({bad} of 4096 values\)"):
        quantize_model(model, PTQConfig(**fields, batch_size=4), token_ids(8, 16), progress=False)


def test_non_finite_first_layer_inputs_name_layer_0():
    model = tiny_hf_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[3] = float("nan")
    ids = token_ids(4, 16)
    ids[2, 7] = 3
    with pytest.raises(DataError, match=r"model\.layers\.0\.self_attn\.[qkv]_proj \(decoder layer 0\)"):
        quantize_model(model, PTQConfig(method="gptq"), ids, progress=False)


# ------------------------------------------------------------------------------------------------
# 3. non-finite weights and any failure while quantizing one Linear name the Linear


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_non_finite_weight_names_the_linear_before_calibration(method, value, no_calibration_run):
    model = tiny_hf_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 7] = value
    with pytest.raises(QuantizationError, match=r"^model\.layers\.1\.mlp\.up_proj: weight contains NaN/inf"):
        quantize_model(model, PTQConfig(method=method), token_ids(4, 16), progress=False)
    assert _n_quantized(model) == 0


def test_non_finite_weight_after_smoothing_names_the_linear(monkeypatch):
    import blockscale.ptq.smoothing.layer as smoothing

    fold = smoothing.fold_smoothing

    def corrupting_fold(group, s):
        fold(group, s)
        if group.name == "mlp.down_proj":
            with torch.no_grad():
                group.linears[0].weight[0, 0] = float("inf")

    monkeypatch.setattr(smoothing, "fold_smoothing", corrupting_fold)
    with pytest.raises(QuantizationError, match=r"^model\.layers\.0\.mlp\.down_proj: weight contains NaN/inf "
                                                r"after method='awq' smoothing"):
        quantize_model(tiny_hf_llama(), PTQConfig(method="awq", batch_size=4), token_ids(8, 16), progress=False)


def test_value_error_while_quantizing_is_prefixed_with_the_linear(monkeypatch):
    import blockscale.ptq.methods.gptq.method as gptq

    def fail(weight, H, *a, **k):
        raise ValueError("H (+ dampening) is not positive definite")

    monkeypatch.setattr(gptq, "gptq_quantize", fail)
    with pytest.raises(QuantizationError, match=r"^model\.layers\.0\.self_attn\.q_proj: H \(\+ dampening\) is not"):
        quantize_model(tiny_hf_llama(), PTQConfig(method="gptq"), token_ids(4, 16), progress=False)


@pytest.mark.parametrize("method", ["awq", "smoothquant", "gptq"])
def test_non_finite_norm_weight_names_the_norm_before_calibration(method, no_calibration_run):
    model = tiny_hf_llama()  # AWQ used to end in "RuntimeError: atol must be greater than or equal to zero"
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[5] = float("nan")
    with pytest.raises(QuantizationError, match=r"^model\.layers\.1\.input_layernorm: weight contains NaN/inf "
                                                r"\(1 of 64 values\)"):
        quantize_model(model, PTQConfig(method=method, activations="w4a4"), token_ids(4, 16), progress=False)


def test_awq_on_mixtral_names_the_layer_before_calibration(no_calibration_run):
    model = tiny_mixtral()  # AWQ smooths Mixtral layers (tests/ptq/test_smoothing_moe.py), not one with a parameter
    model.model.layers[0].mlp.extra = torch.nn.Parameter(torch.ones(64))  # whose role it does not know
    with pytest.raises(QuantizationError, match=r"^model\.layers\.0: method='awq' cannot smooth this layer: "
                                                r"find_smoothing_groups: MixtralDecoderLayer is not a supported"
                                                r".*MoE / MLA layout: parameter 'mlp\.extra' belongs to no module"):
        quantize_model(model, PTQConfig(method="awq", allow_partial=True), token_ids(4, 16), progress=False)


def test_nan_norm_weight_in_smoothing_probe_is_a_value_error():
    from blockscale.ptq.smoothing import check_norm_absorbs_scales

    norm = torch.nn.RMSNorm(32)
    with torch.no_grad():
        norm.weight[4] = float("nan")
    with pytest.raises(ValueError, match="RMSNorm.weight contains NaN/inf"):
        check_norm_absorbs_scales(norm)


# ------------------------------------------------------------------------------------------------
# 4. calibration ids outside the vocabulary, empty calibration sets


@pytest.mark.parametrize("bad", [96, 1000, -1])
def test_calibration_ids_outside_the_vocabulary(bad, no_calibration_run):
    ids = torch.arange(64).reshape(4, 16)
    ids[1, 3] = bad
    with pytest.raises(DataError, match=rf"calibration token ids must be in \[0, 96\) \(the model's vocabulary "
                                        rf"size is 96\); got min {min(bad, 0)}, max {max(bad, 63)}"):
        quantize_model(tiny_hf_llama(), PTQConfig(method="gptq"), ids, progress=False)


@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (0, 0)])
def test_empty_calibration_set(shape, no_calibration_run):
    with pytest.raises(DataError, match=rf"calibration has shape \({shape[0]}, {shape[1]}\)"):
        quantize_model(tiny_hf_llama(), PTQConfig(method="awq"), torch.zeros(shape, dtype=torch.long),
                       progress=False)


def test_calibration_vocab_of_a_plain_module_with_one_embedding(no_calibration_run):
    class Plain(torch.nn.Module):  # not a transformers model: the vocabulary is its one nn.Embedding
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(40, 32)
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32)) for _ in range(2))

    with pytest.raises(DataError, match=r"vocabulary size is 40"):
        quantize_model(Plain(), PTQConfig(method="gptq"), token_ids(2, 8, vocab=96), progress=False)


def test_copy_of_model_is_untouched_by_refusal():
    model = tiny_mixtral()
    ref = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError):
        quantize_model(model, PTQConfig(exclude=NO_EXPERTS), progress=False)
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
