"""AWQ and SmoothQuant on gpt-oss decoder layers (transformers GptOssForCausalLM): attention with biases and
per-head sinks, the router with a bias, GptOssExperts (gate_up_proj [E, H, 2I] transposed, gate / up
interleaved, biases, clamped GLU). Folding keeps the full-precision model and its routing; AWQ's quantized
error is at most RTN's and is scored on the very matrices NVFP4GptOssExperts stores; SmoothQuant's scales
are the formula's. References are written here by hand."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn.gpt_oss_experts_layout import gpt_oss_expert_matrices
from blockscale.nn.nvfp4_gpt_oss_experts import NVFP4GptOssExperts
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.methods import AWQ, SmoothQuant
from blockscale.ptq.smoothing import SmoothingGroup, WeightSlice, find_moe_smoothing_groups
from blockscale.ptq.smoothing.moe import GPT_OSS_DOWN_NOTE

transformers = pytest.importorskip("transformers")
from smoothing_checks import (Snapshot, column_scale, fold_random_scales, logits_and_routing,  # noqa: E402
                              mlps_from_layer_config)
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, H, I, gpt_oss_glu, tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NOTE = f"mlp.experts.{GPT_OSS_DOWN_NOTE}"


def gpt_oss(kv_heads: int = 2):
    """tiny_gpt_oss (grouped-query attention: 4 heads, 2 KV heads), or the same with ``kv_heads`` KV heads
    (4: no GQA, so v_proj -> o_proj is a group too); either way with non-zero attention and router biases
    and sinks."""
    model = tiny_gpt_oss()
    if kv_heads != model.config.num_key_value_heads:
        cfg = copy.deepcopy(model.config)
        cfg.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                ex = layer.mlp.experts
                ex.gate_up_proj.mul_(20)
                ex.gate_up_proj_bias.normal_(0, 0.5)
                ex.down_proj_bias.normal_(0, 0.5)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for p in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias, layer.mlp.router.bias):
                p.normal_(0, 0.02)  # like the embeddings: larger, o_proj's bias would make every token alike
            a.sinks.normal_(0, 0.5)
    return model


def _double(model):
    model = model.double()
    model.config._experts_implementation = "eager"  # grouped_mm has no float64
    return model


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_folding_random_scales_keeps_logits_and_routing(kv_heads):
    model = _double(gpt_oss(kv_heads))
    ids = token_ids(2, 24)
    ref, ref_picks = logits_and_routing(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fold_random_scales(model, notes=[NOTE])
    out, picks = logits_and_routing(model, ids)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    layer = "model.layers.1."
    must = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "post_attention_layernorm.weight", "mlp.router.weight", "mlp.experts.gate_up_proj"]
    # column scaling leaves the consumers' biases alone; sinks and the experts' down side take no part
    kept = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.sinks", "mlp.router.bias",
            "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj", "mlp.experts.down_proj_bias",
            "self_attn.o_proj.bias"]
    if kv_heads == 4:  # v_proj -> o_proj: v_proj's rows AND its bias divided by s, o_proj's columns times s
        must += ["self_attn.v_proj.bias", "self_attn.o_proj.weight"]
    else:
        kept += ["self_attn.v_proj.bias", "self_attn.o_proj.weight"]
    assert {layer + n for n in must} <= changed, {layer + n for n in must} - changed
    assert not {layer + n for n in kept} & changed, {layer + n for n in kept} & changed
    assert len(picks) == len(ref_picks) == 2
    for a, b in zip(picks, ref_picks):
        assert torch.equal(a, b)  # the same experts for every token
    # the fold computes in FP32 (weights stored back rounded to FP32) and HF RMSNorms compute in FP32:
    # that rounding is all that separates the folded model, relative 1e-5 of the largest logit
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_folding_without_the_router_would_change_the_model():
    """The test above can fail: leaving the router out of the post-attention-norm group changes routing."""
    model = _double(gpt_oss())
    ids = token_ids(2, 24)
    ref, ref_picks = logits_and_routing(model, ids)
    fold_random_scales(model, drop_router=True, notes=[NOTE])
    out, picks = logits_and_routing(model, ids)
    assert any(not torch.equal(a, b) for a, b in zip(picks, ref_picks))
    assert float((out - ref).abs().max()) > 1e-3 * float(ref.abs().max())


def test_an_up_to_down_fold_would_change_the_experts():
    """Why there is no up -> down group: dividing expert e's up columns (and bias) by s and multiplying
    down_proj's input rows by s is exact for a linear-in-up GLU, not for gpt-oss's clamped (up + 1) GLU."""
    ex = _double(gpt_oss()).model.layers[0].mlp.experts
    x = torch.randn(32, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = torch.exp(0.5 * torch.randn(I, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    e = 0
    W, b, D = ex.gate_up_proj[e].detach(), ex.gate_up_proj_bias[e].detach(), ex.down_proj[e].detach()
    y = ex._apply_gate(x @ W + b) @ D
    W2, b2 = W.clone(), b.clone()
    W2[:, 1::2] /= s
    b2[1::2] /= s
    y2 = ex._apply_gate(x @ W2 + b2) @ (D * s[:, None])
    assert float((y2 - y).abs().max()) > 1e-2 * float(y.abs().max())


def test_groups_of_a_gpt_oss_layer():
    model = gpt_oss()
    layer = model.model.layers[0]
    groups, notes = find_moe_smoothing_groups(layer)
    assert [g.name for g in groups] == ["self_attn.qkv", "mlp.gate_up"]  # GQA: no v -> o; no up -> down
    assert notes == [NOTE] and "not smoothed" in NOTE
    qkv, gu = groups
    assert isinstance(qkv, SmoothingGroup) and qkv.prev is layer.input_layernorm
    assert qkv.linear_names == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert gu.prev is layer.post_attention_layernorm and gu.prev_name == "post_attention_layernorm"
    assert [c.name for c in gu.consumers] == ["mlp.router", *["mlp.experts"] * E]
    router = gu.consumers[0].weight
    assert router.module is layer.mlp.router and router.tensor() is layer.mlp.router.weight
    ex = layer.mlp.experts
    ref_gu, _ = gpt_oss_expert_matrices(ex)  # the [E, 2I, H] out x in matrices NVFP4GptOssExperts quantizes
    for e, c in enumerate(gu.consumers[1:]):
        w = c.weight
        assert (w.module, w.param, w.expert, w.transposed, w.proj) == (ex, "gate_up_proj", e, True, "gate_up")
        t = w.tensor()
        assert t.shape == (2 * I, H) and torch.equal(t, ref_gu[e])
        assert t.data_ptr() == ex.gate_up_proj[e].data_ptr()  # a view of the parameter
    # writing the view writes the parameter
    with torch.no_grad():
        gu.consumers[2].weight.tensor()[3, 5] = 123.0
    assert float(ex.gate_up_proj[1, 5, 3].detach()) == 123.0
    # without GQA the v_proj -> o_proj group is found, v_proj (with its bias) as the producer
    layer4 = gpt_oss(4).model.layers[0]
    names = [g.name for g in find_moe_smoothing_groups(layer4)[0]]
    assert names == ["self_attn.qkv", "self_attn.o_proj", "mlp.gate_up"]
    vo = find_moe_smoothing_groups(layer4)[0][1]
    assert vo.prev is layer4.self_attn.v_proj and vo.linears == (layer4.self_attn.o_proj,)


def test_transposed_weight_slice_write_with_index():
    ex = gpt_oss().model.layers[0].mlp.experts
    sl = WeightSlice(ex, "gate_up_proj", 2, index=(1, 3, 5), transposed=True)  # up rows 0..2 of expert 2
    assert torch.equal(sl.tensor(), ex.gate_up_proj[2].detach().T[[1, 3, 5]])
    with torch.no_grad():
        sl.write(torch.full((3, H), 2.5))
    assert bool((ex.gate_up_proj[2][:, [1, 3, 5]] == 2.5).all())
    assert not bool((ex.gate_up_proj[2][:, [0, 2, 4]] == 2.5).any())


# ------------------------------------------------------------------------------------------------
# AWQ and SmoothQuant end to end, checked on layer 0 (attention kept in high precision, so the MoE block
# sees the full-precision model's inputs)


def _inputs(model, ids):
    """Layer 0's MoE block input (all tokens) and each expert's routed token mask [T, E]."""
    got = {}
    layer = model.model.layers[0]
    h1 = layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: got.__setitem__("x", o.detach()))
    h2 = layer.mlp.router.register_forward_hook(lambda m, a, o: got.__setitem__("idx", o[-1].detach()))
    with torch.no_grad():
        model(ids)
    h1.remove()
    h2.remove()
    x = got["x"].reshape(-1, H).float()
    return x, torch.nn.functional.one_hot(got["idx"], E).sum(1).bool()


def _expert_err(ex, x, routed, s, deq, W):
    """By hand: sum_e ||f_e((x_e / s) Q_e^T) - f_e(x_e W_e^T)||^2 over each expert's routed tokens x_e, with
    f_e(y) = glu(y + gate_up_proj_bias[e]) @ down_proj[e] (the clamped GLU on interleaved columns, full-precision
    down), Q_e [2I, H] the stored NVFP4 gate_up weights, W_e = gate_up_proj[e]^T; and the element count T_e H."""
    total, count = 0.0, 0
    for e in range(E):
        xe = x[routed[:, e]]
        b, D = ex.gate_up_proj_bias[e].detach().float(), ex.down_proj[e].detach().float()
        f = lambda y: gpt_oss_glu(y + b, ex.alpha, ex.limit) @ D  # noqa: E731
        total += float((f((xe / s) @ deq[e].T) - f(xe @ W[e].T)).double().square().sum())
        count += xe.shape[0] * H
    return total, count


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_awq_on_gpt_oss_error_at_most_rtn(act, monkeypatch):
    import blockscale.ptq.methods.awq as awq_mod

    results = []
    orig = awq_mod.awq_search_parts

    def spy(parts, **kw):
        res = orig(list(parts), **kw)
        results.append(res)
        return res

    monkeypatch.setattr(awq_mod, "awq_search_parts", spy)
    ids = token_ids(8, 32)
    ref = gpt_oss()
    x, routed = _inputs(ref, ids)
    assert bool(routed.any(0).all())
    rtn, awq = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(rtn, mlps_from_layer_config("rtn", 0, activations=act), ids, progress=False)
    snap = Snapshot(monkeypatch, AWQ, 0)
    rep = quantize_model(awq, mlps_from_layer_config("awq", 0, activations=act), ids, progress=False)
    assert len(rep.experts) == 2 and len(results) == 2  # one MoE group per layer, no up -> down groups
    assert f"model.layers.*.{NOTE}" in rep.warnings
    f_layer, r_layer, a_layer = (m.model.layers[0] for m in (ref, rtn, awq))
    assert isinstance(a_layer.mlp.experts, NVFP4GptOssExperts)
    s1 = f_layer.post_attention_layernorm.weight.detach().float() / a_layer.post_attention_layernorm.weight.detach()
    assert float((s1 - 1).abs().max()) > 1e-3  # AWQ did smooth this group
    P = snap.params  # the folded layer: router and experts' gate_up rows times s, biases untouched
    torch.testing.assert_close(column_scale(P["mlp.router.weight"], f_layer.mlp.router.weight.detach()), s1,
                               rtol=2e-6, atol=0)
    assert torch.equal(P["mlp.router.bias"], f_layer.mlp.router.bias.detach())
    assert torch.equal(a_layer.mlp.experts.gate_up_proj_bias, f_layer.mlp.experts.gate_up_proj_bias)
    W, _ = gpt_oss_expert_matrices(f_layer.mlp.experts)  # [E, 2I, H]
    torch.testing.assert_close(P["mlp.experts.gate_up_proj"], f_layer.mlp.experts.gate_up_proj.detach() * s1[:, None],
                               rtol=1e-6, atol=0)
    # the MoE block's output error on the calibration data (routing, clamped GLU, down and biases included)
    X = x.reshape(1, -1, H)
    with torch.no_grad():
        y = f_layer.mlp(X)[0]
        err_rtn = float((r_layer.mlp(X)[0] - y).double().square().sum())
        err_awq = float((a_layer.mlp(X / s1)[0] - y).double().square().sum())
    assert err_awq <= err_rtn
    if act == "w4a4":
        return
    # the searched error, by hand from the stored NVFP4 weights: AWQ scored Q(W s) on the out x in [2I, H]
    # matrices NVFP4GptOssExperts stores, each expert's error after its clamped GLU and full-precision down
    # (its reported error is this one), at most RTN's (s = 1 is in the grid)
    dq_a, _ = a_layer.mlp.experts.dequantized(torch.float32)
    dq_r, _ = r_layer.mlp.experts.dequantized(torch.float32)
    e_awq, n = _expert_err(f_layer.mlp.experts, x, routed, s1, dq_a, W)
    e_rtn, _ = _expert_err(f_layer.mlp.experts, x, routed, torch.ones(H), dq_r, W)
    res = results[0]
    assert res.alpha > 0
    assert e_awq / n == pytest.approx(res.error, rel=1e-4)
    assert e_rtn / n == pytest.approx(res.baseline_error, rel=1e-4)
    assert e_awq < e_rtn


@pytest.mark.parametrize("fmt,act", [("compressed-tensors", "w4a16"), ("modelopt", "w4a4")])
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_smoothed_gpt_oss_export_reload_logits_bit_for_bit(tmp_path, method, fmt, act):
    model = gpt_oss()
    ids = token_ids(4, 16)
    rep = quantize_model(model, PTQConfig(method=method, activations=act), ids, progress=False)
    assert all(lr.smoothing_alpha is not None for lr in rep.linears if ".self_attn.q_proj" in lr.name)
    r = load_checkpoint(export_checkpoint(model, tmp_path / "ck", fmt))
    assert isinstance(r.model.layers[0].mlp.experts, NVFP4GptOssExperts)
    with torch.no_grad():
        assert torch.equal(r(ids[:2]).logits, model(ids[:2]).logits)


def test_smoothquant_gpt_oss_scales_are_the_formula(monkeypatch):
    ids = token_ids(8, 32)
    ref = gpt_oss()
    x, routed = _inputs(ref, ids)
    model = copy.deepcopy(ref)
    snap = Snapshot(monkeypatch, SmoothQuant, 0)
    quantize_model(model, mlps_from_layer_config("smoothquant", 0), ids, progress=False)
    f_layer, P = ref.model.layers[0], snap.params
    # by hand: s_j = max|X_j|^0.5 / max|W_j|^0.5, X: every token routed to an expert (the union of the
    # quantized consumers' inputs), W: every expert's gate_up_proj[e] row j (its out x in matrix's column j);
    # not the router, which stays in high precision
    union = routed.any(1)
    assert bool(union.all())  # top-2 routing: every token reaches some expert
    gu = f_layer.mlp.experts.gate_up_proj.detach().float()  # [E, H, 2I]
    wmax = gu.abs().amax(2).amax(0).double()
    s1 = (x[union].abs().amax(0).double().sqrt() / wmax.sqrt()).float()
    norm = f_layer.post_attention_layernorm.weight.detach().float()
    torch.testing.assert_close(norm / P["post_attention_layernorm.weight"], s1, rtol=2e-6, atol=0)
    torch.testing.assert_close(column_scale(P["mlp.router.weight"], f_layer.mlp.router.weight.detach()), s1,
                               rtol=2e-6, atol=0)  # rescaled too
    torch.testing.assert_close(P["mlp.experts.gate_up_proj"], gu * s1[:, None], rtol=1e-6, atol=0)
    for k in ("mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
              "mlp.experts.down_proj_bias"):
        assert torch.equal(P[k], f_layer.get_parameter(k).detach().float()), k


def test_awq_with_one_outer_scale_for_all_gpt_oss_experts(monkeypatch):
    """expert_outer_scale="tensor": one part holding every expert's gate_up [2I, H] (one shared scale), each
    expert on its own tokens with its own output function; calibrate_all feeds every token to every expert."""
    import blockscale.ptq.methods.awq as awq_mod

    seen = []
    orig = awq_mod.awq_search_parts

    def spy(parts, **kw):
        parts = list(parts)
        seen.append([[(tuple(x.shape), [tuple(w.shape) for w in ws], len(rest)) for x, ws, *rest in inputs]
                     for _, inputs in parts])
        return orig(parts, **kw)

    monkeypatch.setattr(awq_mod, "awq_search_parts", spy)
    model = gpt_oss()
    ids = token_ids(4, 16)
    with torch.no_grad():
        ref = model(ids).logits
    rep = quantize_model(model, PTQConfig(method="awq", activations="w4a4", expert_outer_scale="tensor",
                                          calibrate_all_experts=True), ids, progress=False)
    assert [r.outer_scale for r in rep.experts] == ["tensor", "tensor"]
    assert seen == [[[((ids.numel(), H), [(2 * I, H)], 1)] * E]] * 2  # per layer: one part, E inputs
    with torch.no_grad():
        out = model(ids).logits
    assert float((out - ref).square().mean() / ref.square().mean()) < 0.5
