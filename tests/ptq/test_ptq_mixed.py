"""Mixed-precision PTQ recipes: per-module NVFP4 / FP8 / MX schemes, fused groups sharing their scales,
every method on every family, the all-NVFP4 recipe equal to the flat config bit for bit, calibrated FP8
KV-cache scales of the quantized layers, fixed-grid GPTQ."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.errors import QuantizationError
from blockscale.nn.fp8_linear import FP8Linear
from blockscale.nn.mx_linear import MXLinear
from blockscale.nn.nvfp4_linear import NVFP4Linear
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
from blockscale.ptq.methods.gptq import gptq_fixed_grid
from blockscale.recipes.ptq_builtin import get_ptq_recipe
from blockscale.recipes.ptq_recipe import KVCacheScheme, PTQRecipe, PTQRule, Scheme

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.weight[:3] *= 8
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return m


def calib(n=8, t=32, seed=0):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def cfg(recipe, method="rtn", **kw):
    return PTQConfig(method=method, recipe=recipe, n_samples=8, seq_len=32, batch_size=kw.pop("batch_size", 4), **kw)


def fp8_ref(w, s):
    """Independent FP8 reference: torch's own cast of the clamped quotient."""
    return (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)


def layer_input_amax(model, module, ids):
    """max |x| of ``module``'s inputs over a forward of ``model`` on ``ids`` (full precision)."""
    seen = []
    h = module.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().abs().max()))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    return torch.stack(seen).max()


# ----------------------------------------------------------------------------------------------
# the write-up's recipe


def test_nvfp4_experts_fp8_attention_recipe_modules_and_scales():
    model, ids = tiny_llama(), calib()
    orig = copy.deepcopy(model)
    rep = quantize_model(model, cfg("nvfp4-experts-fp8-attention"), ids, progress=False)
    labels = {lr.name: lr.scheme for lr in rep.linears}
    assert len(labels) == 14
    amax0 = layer_input_amax(orig, orig.model.layers[0].self_attn.q_proj, ids)
    for i, layer in enumerate(model.model.layers):
        attn, oattn = layer.self_attn, orig.model.layers[i].self_attn
        for n in ATTN:
            m = getattr(attn, n)
            assert isinstance(m, FP8Linear) and m.scheme_name == "fp8-w8a8" and m.input_granularity == "tensor"
            assert labels[f"model.layers.{i}.self_attn.{n}"] == "fp8-w8a8"
        for n in MLP:
            m = getattr(layer.mlp, n)
            assert isinstance(m, NVFP4Linear) and m.scheme_name == "nvfp4-w4a4"
            assert labels[f"model.layers.{i}.mlp.{n}"] == "nvfp4-w4a4"
        # fused q/k/v: one weight scale = max amax / 448, one input scale; codes = the reference
        ws = [getattr(oattn, n).weight for n in ("q_proj", "k_proj", "v_proj")]
        s = torch.stack([w.abs().max() for w in ws]).max() / 448
        for n, w in zip(("q_proj", "k_proj", "v_proj"), ws):
            m = getattr(attn, n)
            assert torch.equal(m.weight_scale, s.reshape(1))
            assert torch.equal(m.weight.view(torch.uint8), fp8_ref(w, s).view(torch.uint8))
            assert torch.equal(m.input_scale, attn.q_proj.input_scale)
        so = oattn.o_proj.weight.abs().max() / 448  # o_proj alone
        assert torch.equal(attn.o_proj.weight_scale, so.reshape(1))
        assert torch.equal(attn.o_proj.weight.view(torch.uint8), fp8_ref(oattn.o_proj.weight, so).view(torch.uint8))
        if i == 0:  # layer 0's inputs are the embeddings: the calibrated amax is the full-precision one
            assert torch.equal(attn.q_proj.input_scale, (amax0 / 448).reshape(1))
        assert attn.k_scale.shape == (1,) and attn.v_scale.shape == (1,)
    assert set(rep.kv_cache) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert isinstance(model.lm_head, nn.Linear) and "lm_head" in rep.kept_high_precision
    with torch.no_grad():
        y, y0 = model(ids).logits, orig(ids).logits
    assert torch.isfinite(y).all() and (y - y0).pow(2).mean() < 0.1 * y0.pow(2).mean()


def _post_rope_kv(layer, hidden, pos_emb):
    """Post-RoPE K and V of ``layer``'s attention on decoder-layer input ``hidden`` (transformers' own ops)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    _, k = apply_rotary_pos_emb(q, k, *pos_emb)
    return k, v


@pytest.mark.parametrize("per_head", [False, True])
def test_kv_scales_are_amax_over_448_of_the_quantized_layers_post_rope_kv(per_head):
    model, ids = tiny_llama(), calib()
    recipe = get_ptq_recipe("nvfp4-experts-fp8-attention").replace(kv_cache=KVCacheScheme(per_head=per_head))
    rep = quantize_model(model, cfg(recipe, batch_size=8), ids, progress=False)
    with torch.no_grad():  # the quantized model with its KV fake quantization: each layer's real inputs
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        pos = torch.arange(ids.shape[1])[None]
        pos_emb = model.model.rotary_emb(out.hidden_states[0], pos)
        for i, layer in enumerate(model.model.layers):
            k, v = _post_rope_kv(layer, out.hidden_states[i], pos_emb)
            red = (lambda t: t.abs().amax(dim=(0, 2, 3))) if per_head else (lambda t: t.abs().max().reshape(1))
            k_amax, v_amax = red(k), red(v)
            attn = layer.self_attn
            assert attn.k_scale.shape == k_amax.shape == ((2,) if per_head else (1,))
            assert torch.equal(attn.k_scale, k_amax / 448) and torch.equal(attn.v_scale, v_amax / 448)
            entry = rep.kv_cache[f"model.layers.{i}.self_attn"]
            assert entry["k_amax"] == k_amax.tolist() and entry["v_scale"] == (v_amax / 448).tolist()


def test_kv_fake_quant_changes_the_next_layers_inputs():
    """Layer 1 calibrates on the outputs of layer 0 with its K/V quantized, as a server computes them."""
    ids = calib()
    with_kv = tiny_llama()
    quantize_model(with_kv, cfg("nvfp4-experts-fp8-attention"), ids, progress=False)
    without = tiny_llama()
    quantize_model(without, cfg(get_ptq_recipe("nvfp4-experts-fp8-attention").replace(kv_cache=None)), ids,
                   progress=False)
    a, b = with_kv.model.layers, without.model.layers
    assert torch.equal(a[0].self_attn.q_proj.input_scale, b[0].self_attn.q_proj.input_scale)
    assert not torch.equal(a[1].self_attn.q_proj.input_scale, b[1].self_attn.q_proj.input_scale)
    assert not hasattr(b[0].self_attn, "k_scale") or b[0].self_attn._buffers.get("k_scale") is None


# ----------------------------------------------------------------------------------------------
# every method on every family

RECIPES = {
    "mixed": ("nvfp4-experts-fp8-attention", {ATTN: (FP8Linear, "fp8-w8a8"), MLP: (NVFP4Linear, "nvfp4-w4a4")}),
    "fp8": ("fp8", {ATTN + MLP: (FP8Linear, "fp8-w8a8")}),
    "mxfp4-w4a16": ("mxfp4-w4a16", {ATTN + MLP: (MXLinear, "mxfp4-w4a16")}),
    "fp8-block-mxfp8": (PTQRecipe(name="blk", default=Scheme("mxfp8"),
                                  rules=(PTQRule("attention", Scheme("fp8-block")),)),
                        {ATTN: (FP8Linear, "fp8-block"), MLP: (MXLinear, "mxfp8")}),
}
METHOD_CONFIGS = {"rtn": None, "awq": AWQOptions(grid=4), "smoothquant": None, "gptq": GPTQOptions(block_size=32)}


@pytest.mark.parametrize("recipe_key", list(RECIPES))
@pytest.mark.parametrize("method", list(METHOD_CONFIGS))
def test_every_method_runs_on_every_family(method, recipe_key):
    recipe, want = RECIPES[recipe_key]
    model, ids = tiny_llama(), calib()
    orig = copy.deepcopy(model)
    rep = quantize_model(model, cfg(recipe, method, options=METHOD_CONFIGS[method]), ids, progress=False)
    assert len(rep.linears) == 14
    for i, layer in enumerate(model.model.layers):
        for names, (cls, scheme) in want.items():
            for n in names:
                m = layer.get_submodule(f"self_attn.{n}" if n in ATTN else f"mlp.{n}")
                assert isinstance(m, cls) and m.scheme_name == scheme, (n, m)
    assert {lr.scheme for lr in rep.linears} == {s for _, s in want.values()}
    if method in ("awq", "smoothquant"):
        assert all(lr.smoothing_alpha is not None for lr in rep.linears if "q_proj" in lr.name)
    if method == "gptq":
        assert all(lr.output_rel_err is not None and lr.rtn_output_rel_err is not None for lr in rep.linears)
        if recipe_key == "fp8":
            assert all(lr.output_rel_err <= lr.rtn_output_rel_err for lr in rep.linears), rep.linears
    with torch.no_grad():
        y, y0 = model(ids).logits, orig(ids).logits
    assert torch.isfinite(y).all() and (y - y0).pow(2).mean() < 0.2 * y0.pow(2).mean()


def test_rtn_mx_and_fp8_channel_weights_equal_quantize():
    model = tiny_llama()
    orig = copy.deepcopy(model)
    recipe = PTQRecipe(name="t", default=Scheme("mxfp4-w4a16"),
                       rules=(PTQRule("attention", Scheme("fp8-w8a8", weights="channel", activations="dynamic")),))
    quantize_model(model, cfg(recipe), progress=False)  # nothing static: RTN needs no calibration
    for n in MLP:
        m, w = model.model.layers[1].mlp.get_submodule(n), orig.model.layers[1].mlp.get_submodule(n).weight
        ref = bs.quantize(w, bs.MX("e2m1"))
        assert torch.equal(m.weight_packed, ref.codes) and torch.equal(m.weight_scale, ref.scales)
    for n in ATTN:
        m, w = model.model.layers[0].self_attn.get_submodule(n), orig.model.layers[0].self_attn.get_submodule(n).weight
        s = w.abs().amax(1, keepdim=True) / 448
        assert m.input_granularity == "token" and torch.equal(m.weight_scale, s)
        assert torch.equal(m.weight.view(torch.uint8), fp8_ref(w, s).view(torch.uint8))


def test_gptq_fp8_output_error_at_most_rtn_stories260k(stories260k):
    from blockscale.data.text_sources import calibration_batches

    lm = stories260k
    ids = calibration_batches(lm.tokenizer, "tinystories#0.8:1", 8, 128, bos=True)
    for recipe in ("fp8", PTQRecipe(name="c", default=Scheme("fp8-w8a8", weights="channel"))):
        m = copy.deepcopy(lm.model)
        rep = quantize_model(m, PTQConfig(method="gptq", recipe=recipe), ids, progress=False)
        assert len(rep.linears) == 5 * 7  # FP8 takes down_proj's 172 inputs
        for lr in rep.linears:
            assert lr.output_rel_err <= lr.rtn_output_rel_err, lr


# ----------------------------------------------------------------------------------------------
# NVFP4 through a recipe: unchanged bit for bit


@pytest.mark.parametrize("method", ["rtn", "awq", "smoothquant", "gptq"])
def test_all_nvfp4_recipe_equals_the_flat_config(method):
    ids = calib()
    opts = METHOD_CONFIGS[method]
    flat = dict(scale_rule="4over6", error="mae", activations="w4a4", act_scale_rule="4over6")
    a, b = tiny_llama(), tiny_llama()
    quantize_model(a, cfg(None, method, options=opts, **flat), ids, progress=False)
    recipe = PTQRecipe.single(Scheme("nvfp4-w4a4", scale_rule="4over6", error="mae", act_scale_rule="4over6"))
    rep = quantize_model(b, cfg(recipe, method, options=opts), ids, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1
                                                          else sa[k], sb[k].view(torch.uint8)
                                                          if sb[k].dtype.itemsize == 1 else sb[k]), k
    assert {lr.scheme for lr in rep.linears} == {"nvfp4-w4a4 4over6-mae a:4over6"}
    assert "recipe" in rep.config and "recipe" not in PTQConfig().to_dict()


def test_builtin_nvfp4_recipe_equals_the_default_config():
    a, b = tiny_llama(), tiny_llama()
    quantize_model(a, PTQConfig(), progress=False)
    quantize_model(b, PTQConfig(recipe="nvfp4"), progress=False)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x.float(), y.float()), k


# ----------------------------------------------------------------------------------------------
# refusals before calibrating


def test_rule_splitting_a_fused_group_is_refused_before_calibrating():
    recipe = PTQRecipe(name="split", default=Scheme("nvfp4-w4a16"), rules=(PTQRule("*.q_proj", Scheme("fp8-w8a8")),))
    # calibration=None: had it got that far, a method that calibrates would refuse the missing data instead
    with pytest.raises(QuantizationError, match="fused sibling .*k_proj"):
        quantize_model(tiny_llama(), PTQConfig(method="gptq", recipe=recipe), None, progress=False)


def test_mx_needs_whole_32_blocks():
    cfg_ = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg_).eval()
    with pytest.raises(QuantizationError, match="not a multiple of 32"):
        quantize_model(model, PTQConfig(recipe="mxfp4-w4a16"), progress=False)
    rep = quantize_model(copy.deepcopy(model), PTQConfig(recipe="mxfp4-w4a16", skip_indivisible=True,
                                                         allow_partial=True), progress=False)
    assert [lr.name.rsplit(".", 1)[1] for lr in rep.linears] == ["down_proj"]  # 96 inputs


def test_bf16_scheme_keeps_linears_in_high_precision():
    recipe = PTQRecipe(name="t", default=Scheme("nvfp4-w4a16"), rules=(PTQRule("*.o_proj", Scheme("bf16")),))
    model = tiny_llama()
    rep = quantize_model(model, PTQConfig(recipe=recipe), progress=False)
    assert isinstance(model.model.layers[0].self_attn.o_proj, nn.Linear)
    assert "model.layers.0.self_attn.o_proj" in rep.kept_high_precision and len(rep.linears) == 12


def test_kv_cache_only_recipe_needs_no_allow_partial():
    """Linears the recipe keeps in bf16 on purpose do not trigger the "mostly high precision" refusal
    (it is for what PTQ cannot quantize): an FP8-KV-only recipe quantizes K / V and nothing else."""
    from blockscale.nn.kv_cache import attention_modules, kv_scales

    recipe = PTQRecipe(name="kv-only", default=Scheme("bf16"), kv_cache=KVCacheScheme())
    model = tiny_llama()
    ref = copy.deepcopy(model)
    rep = quantize_model(model, cfg(recipe), calibration=calib(), progress=False)
    assert rep.linears == [] and rep.high_precision_fraction == 1.0 and len(rep.kv_cache) == 2
    assert all(kv_scales(a) is not None for a in attention_modules(model).values())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    x = calib(2, 16, seed=9)
    with torch.no_grad():
        assert not torch.equal(model(x).logits, ref(x).logits)  # only K / V changed
    with pytest.raises(QuantizationError, match="allow_partial"):  # unintended high precision still refused
        quantize_model(copy.deepcopy(ref), cfg(PTQRecipe(name="x", ignore=(r"\.(mlp|self_attn)\.",))), calibration=calib(),
                       progress=False)


# ----------------------------------------------------------------------------------------------
# fixed-grid GPTQ


@pytest.mark.parametrize("spec", [bs.FP8("e4m3", "tensor"), bs.FP8("e4m3", "channel"),
                                  bs.FP8("e4m3", "block", (128, 128)), bs.MX("e4m3"), bs.MX("e2m1"),
                                  bs.MX("e2m1", "floor")])
def test_fixed_grid_gptq_with_diagonal_hessian_is_rtn(spec):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(136, 160, generator=g)
    H = torch.diag(torch.rand(160, generator=g) + 0.5)
    q, _ = gptq_fixed_grid(w, H, spec, None, GPTQOptions(block_size=48))
    ref = bs.quantize(w, spec)
    assert torch.equal(q.codes.view(torch.uint8), ref.codes.view(torch.uint8)) and torch.equal(q.scales, ref.scales)


@pytest.mark.parametrize("spec", [bs.FP8("e4m3", "channel"), bs.MX("e2m1")])
@pytest.mark.parametrize("act_order", [False, True])
def test_fixed_grid_gptq_beats_rtn_on_correlated_inputs(spec, act_order):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated channels
    H = 2 * x.T @ x / x.shape[0]
    w = torch.randn(32, 64, generator=g)
    q, stats = gptq_fixed_grid(w, H, spec, None, GPTQOptions(act_order=act_order))
    dq = q.dequantize()  # its codes rebuild exactly what the loop computed
    err = lambda d: float(((d @ H) * d).sum())  # noqa: E731
    assert err(dq - w) < err(bs.quantize(w, spec).dequantize() - w)
    assert stats["dead_columns"] == 0


# ----------------------------------------------------------------------------------------------
# AWQ's search with a scheme


def test_awq_search_measures_the_error_with_the_groups_scheme():
    from blockscale.ptq import awq_search

    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.1, 4, 64)
    ws = [torch.randn(48, 64, generator=g), torch.randn(16, 64, generator=g)]
    res = awq_search(x, ws, None, scheme=Scheme("fp8-w8a8"), n_grid=5)
    # alpha = 0 (s = 1) independently: one weight scale for the group, a static input scale
    s_w = torch.stack([w.abs().max() for w in ws]).max() / 448
    Q = torch.cat([fp8_ref(w, s_w).float() * s_w for w in ws])
    s_in = x.abs().max() / 448
    xq = (x / s_in).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s_in
    want = float((xq.double() @ Q.double().T - x.double() @ torch.cat(ws).double().T).square().mean())
    assert res.baseline_error == pytest.approx(want, rel=1e-5)
    assert res.error <= res.baseline_error and len(res.errors) == 5
    mx = awq_search(x, ws, None, scheme=Scheme("mxfp4-w4a16"), n_grid=5)
    assert mx.errors != res.errors and mx.error <= mx.baseline_error
    # an NVFP4 scheme is the NVFP4 search itself
    a = awq_search(x, ws, None, scheme=Scheme("nvfp4-w4a4", scale_rule="4over6"), n_grid=5)
    b = awq_search(x, ws, bs.NVFP4(scale_rule="4over6"), act_scale_rule="6", n_grid=5)
    assert a.errors == b.errors and torch.equal(a.scales, b.scales)
