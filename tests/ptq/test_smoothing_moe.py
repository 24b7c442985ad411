"""AWQ and SmoothQuant on MoE decoder layers (fused 3-D experts and the per-expert nn.Linear layout;
Mixtral, Qwen2-MoE with shared_expert + shared_expert_gate, Qwen3-MoE, OLMoE, DeepSeek-V3 with
shared_experts, its 2-D-weight router and MLA attention): folding keeps the full-precision model and its
routing, AWQ's quantized error is at most RTN's on the calibration data, SmoothQuant's scales are the
formula's, written here by hand."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from blockscale.errors import QuantizationError
from blockscale.nn import NVFP4Experts, NVFP4Linear
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.methods import AWQ, SmoothQuant
from blockscale.ptq.smoothing import find_moe_smoothing_groups
from blockscale.recipes.recipe import DEFAULT_EXCLUDE

transformers = pytest.importorskip("transformers")
from smoothing_checks import (Snapshot, column_scale, fold_random_scales, logits_and_routing,  # noqa: E402
                              mlps_from_layer_config)
from tiny_models import token_ids  # noqa: E402
from tiny_moe import tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_deepseek(seed: int = 0, first_dense: int = 1):
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=first_dense, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


class ExpertMLP(nn.Module):
    """One expert of the transformers-4 layout: down(act(gate(x)) * up(x)) of nn.Linear."""

    def __init__(self, gate, up, down, act, names):
        super().__init__()
        self.names, self.act_fn = names, act
        for n, w in zip(names, (gate, up, down)):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            setattr(self, n, lin)

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class LinearExperts(nn.ModuleList):
    """The per-expert nn.Linear layout with the weights and the forward of a fused experts module."""

    def __init__(self, fused, names):
        I = fused.gate_up_proj.shape[1] // 2
        super().__init__([ExpertMLP(gu[:I], gu[I:], dn, fused.act_fn, names)
                          for gu, dn in zip(fused.gate_up_proj.detach(), fused.down_proj.detach())])

    def forward(self, hidden_states, top_k_index, top_k_weights):  # the transformers eager loop
        out = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
        for e, expert in enumerate(self):
            pos, tok = torch.where(mask[e])
            if tok.numel():
                y = expert(hidden_states[tok]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out


def as_linear_experts(model, names=("gate_proj", "up_proj", "down_proj")):
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = LinearExperts(layer.mlp.experts, names)
    return model


def build(family: str):
    if family == "deepseek_v3":
        return tiny_deepseek()
    if family == "mixtral_linear":  # transformers-4 Mixtral: experts[e].w1 / w3 / w2
        return as_linear_experts(tiny_moe("mixtral"), ("w1", "w3", "w2"))
    if family == "qwen2_moe_linear":  # transformers-4 Qwen2-MoE: experts[e].gate_proj / up_proj / down_proj
        return as_linear_experts(tiny_moe("qwen2_moe"))
    return tiny_moe(family)


FOLD_FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "mixtral_linear", "qwen2_moe_linear"]


@pytest.mark.parametrize("family", FOLD_FAMILIES)
def test_folding_random_scales_keeps_logits_and_routing(family):
    model = build(family).double()
    model.config._experts_implementation = "eager"  # grouped_mm has no float64
    ids = token_ids(2, 24)
    ref, ref_picks = logits_and_routing(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fold_random_scales(model)
    out, picks = logits_and_routing(model, ids)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    layer = "model.layers.1."
    must_change = [layer + "post_attention_layernorm.weight", layer + "mlp.gate.weight"]
    if family in ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3"):
        must_change += [layer + "mlp.experts.gate_up_proj", layer + "mlp.experts.down_proj"]
    else:
        must_change += [n for n in before if n.startswith(layer + "mlp.experts.")]
    if family.startswith("qwen2_moe"):
        must_change += [layer + f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        must_change.append(layer + "mlp.shared_expert_gate.weight")
    if family == "deepseek_v3":
        must_change += [layer + f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        must_change += [layer + f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj",
                                                                  "kv_a_proj_with_mqa", "kv_a_layernorm",
                                                                  "kv_b_proj", "o_proj")]
    assert set(must_change) <= changed, set(must_change) - changed
    assert len(picks) == len(ref_picks) >= 1
    for a, b in zip(picks, ref_picks):
        assert torch.equal(a, b)  # the same experts for every token
    # HF RMSNorms compute in float32: that rounding is all that separates the folded model
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_folding_without_the_router_would_change_the_model():
    """The test above can fail: leaving the router out of the post-attention-norm group changes routing."""
    model = tiny_moe("mixtral").double()
    model.config._experts_implementation = "eager"
    ids = token_ids(2, 24)
    ref, ref_picks = logits_and_routing(model, ids)
    fold_random_scales(model, drop_router=True)
    out, picks = logits_and_routing(model, ids)
    assert any(not torch.equal(a, b) for a, b in zip(picks, ref_picks))
    assert float((out - ref).abs().max()) > 1e-3 * float(ref.abs().max())


def test_moe_groups_of_a_fused_layer():
    layer = tiny_moe("qwen2_moe").model.layers[0]
    groups, notes = find_moe_smoothing_groups(layer)
    assert [g.name for g in groups] == ["self_attn.qkv", "mlp.gate_up", *[f"mlp.experts.{e}.down" for e in range(4)],
                                        "mlp.shared_expert.down_proj"]
    first = groups[1]
    assert first.prev is layer.post_attention_layernorm
    assert [c.name for c in first.consumers] == ["mlp.gate", *["mlp.experts"] * 4, "mlp.shared_expert.gate_proj",
                                                 "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"]
    ex = layer.mlp.experts
    assert [c.weight.expert for c in first.consumers[1:5]] == [0, 1, 2, 3]
    up_rows = groups[3].prev.tensor()  # expert 1's up rows of gate_up_proj feed its down
    assert up_rows.data_ptr() == ex.gate_up_proj[1, 64:].data_ptr() and up_rows.shape == (64, 64)
    assert groups[3].consumers[0].weight.tensor().data_ptr() == ex.down_proj[1].data_ptr()


def test_unknown_moe_layout_is_refused_before_calibration(monkeypatch):
    import blockscale.ptq.capture as capture

    monkeypatch.setattr(capture, "run_layer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    model = tiny_moe("mixtral")
    model.model.layers[0].mlp.extra = nn.Parameter(torch.ones(64))  # a parameter of unknown role
    for method in ("awq", "smoothquant"):
        with pytest.raises(QuantizationError, match=r"^model\.layers\.0: method='%s' cannot smooth this layer: .*"
                                                    r"parameter 'mlp\.extra' belongs to no module" % method):
            quantize_model(model, PTQConfig(method=method), token_ids(4, 16), progress=False)


# ------------------------------------------------------------------------------------------------
# AWQ and SmoothQuant end to end, checked on the first MoE layer (earlier layers and attention kept in
# high precision, so that layer sees the full-precision model's inputs in every run)


def _first_moe(model) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))


def _inputs(model, L, ids):
    """The MoE block input of layer L (all tokens) and each expert's routed token mask [T, E]."""
    got = {}
    layer = model.model.layers[L]
    h1 = layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: got.__setitem__("x", o.detach()))
    h2 = layer.mlp.gate.register_forward_hook(lambda m, a, o: got.__setitem__("idx", o[-1].detach()))
    with torch.no_grad():
        model(ids)
    h1.remove()
    h2.remove()
    x = got["x"].reshape(-1, got["x"].shape[-1]).float()
    E = layer.mlp.gate.weight.shape[0]
    routed = torch.nn.functional.one_hot(got["idx"], E).sum(1).bool()
    return x, routed


def _w(m):
    return m.dequantized_weight(torch.float32) if isinstance(m, NVFP4Linear) else m.weight.detach().float()


def _experts(layer):
    """Per expert (gate, up, down) weights, dequantized when quantized."""
    ex = layer.mlp.experts
    if isinstance(ex, nn.ModuleList):
        return [tuple(_w(getattr(e, n)) for n in e.names) for e in ex]
    gu, dn = ex.dequantized(torch.float32) if isinstance(ex, NVFP4Experts) else (ex.gate_up_proj.detach().float(),
                                                                                  ex.down_proj.detach().float())
    I = gu.shape[1] // 2
    return [(gu[e, :I], gu[e, I:], dn[e]) for e in range(gu.shape[0])]


def _shared(layer):
    for n in ("shared_expert", "shared_experts"):
        if hasattr(layer.mlp, n):
            sh = getattr(layer.mlp, n)
            return sh, (_w(sh.gate_proj), _w(sh.up_proj), _w(sh.down_proj))
    return None, None


def _err(x, q, w):
    """||x q^T - x w^T||^2 (x / s q^T for the folded weights: pass x / s and w * s)."""
    return float((x @ q.T - x @ w.T).double().square().sum())


AWQ_FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "mixtral_linear"]


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
@pytest.mark.parametrize("family", AWQ_FAMILIES)
def test_awq_on_moe_error_at_most_rtn(family, act, monkeypatch):
    ids = token_ids(8, 32)
    ref = build(family)
    L = _first_moe(ref)
    x, routed = _inputs(ref, L, ids)
    rtn, awq = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(rtn, mlps_from_layer_config("rtn", L, activations=act), ids, progress=False)
    snap = Snapshot(monkeypatch, AWQ, L)
    rep = quantize_model(awq, mlps_from_layer_config("awq", L, activations=act), ids, progress=False)
    assert len(rep.experts) == (0 if family.endswith("_linear") else 2 - L)
    f_layer, r_layer, a_layer = (m.model.layers[L] for m in (ref, rtn, awq))
    # the post-attention norm stays in full precision: it holds 1 / s1 of the first MoE group
    s1 = f_layer.post_attention_layernorm.weight.detach().float() / a_layer.post_attention_layernorm.weight.detach()
    assert float((s1 - 1).abs().max()) > 1e-3  # AWQ did smooth this group
    # the layer's total: the MoE block's output error on the calibration data (routing included)
    X = x.reshape(1, -1, x.shape[-1])
    with torch.no_grad():
        y = f_layer.mlp(X)
        err_rtn = float((r_layer.mlp(X) - y).double().square().sum())
        err_awq = float((a_layer.mlp(X / s1) - y).double().square().sum())
    assert err_awq <= err_rtn
    if act == "w4a4":
        return
    # per expert: its up rows -> down group is searched last, on its own routed tokens; AWQ's grid includes
    # s = 1 (RTN), so its down GEMM's output error on those tokens is at most RTN's (float rounding aside)
    P = snap.params
    improved = 0
    for e, ((g, u, d), (_, _, rd), (_, _, ad)) in enumerate(zip(_experts(f_layer), _experts(r_layer),
                                                                 _experts(a_layer))):
        xe = x[routed[:, e]]
        assert xe.shape[0] > 0
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        folded = P[f"mlp.experts.{e}.w2.weight"] if family.endswith("_linear") else P["mlp.experts.down_proj"][e]
        s2 = column_scale(folded, d)  # folded[:, j] = d[:, j] * s2[j]
        e_awq, e_rtn = _err(h / s2, ad, d * s2), _err(h, rd, d)
        assert e_awq <= e_rtn * (1 + 1e-5)
        improved += e_awq < e_rtn * 0.999
    assert improved >= 1


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "qwen2_moe_linear"])
def test_smoothquant_moe_scales_are_the_formula(family, monkeypatch):
    ids = token_ids(8, 32)
    ref = build(family)
    L = _first_moe(ref)
    x, routed = _inputs(ref, L, ids)
    model = copy.deepcopy(ref)
    snap = Snapshot(monkeypatch, SmoothQuant, L)
    quantize_model(model, mlps_from_layer_config("smoothquant", L), ids, progress=False)
    f_layer, q_layer = ref.model.layers[L], model.model.layers[L]
    P = snap.params
    # by hand: s_j = max|X_j|^0.5 / max|W_j|^0.5, X: every token reaching the block (the union of the
    # consumers' inputs), W: the columns of every quantized consumer (experts, shared expert; not the router)
    f_ex = _experts(f_layer)
    cols = [torch.cat([g, u]) for g, u, _ in f_ex]
    sh, f_sh = _shared(f_layer)
    if sh is not None:
        cols += [f_sh[0], f_sh[1]]
    gate = getattr(f_layer.mlp, "shared_expert_gate", None)
    if gate is not None and isinstance(q_layer.mlp.shared_expert_gate, NVFP4Linear):
        cols.append(gate.weight.detach().float())
    wmax = torch.cat(cols).abs().amax(0).double()
    s1 = (x.abs().amax(0).double().sqrt() / wmax.sqrt()).float()
    norm = f_layer.post_attention_layernorm.weight.detach().float()
    torch.testing.assert_close(norm / P["post_attention_layernorm.weight"], s1, rtol=2e-6, atol=0)
    router = f_layer.mlp.gate.weight.detach().float()
    torch.testing.assert_close(column_scale(P["mlp.gate.weight"], router), s1, rtol=2e-6, atol=0)  # rescaled too
    for e, (g, u, d) in enumerate(f_ex):
        xe = x[routed[:, e]]
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        s2 = (h.abs().amax(0).double().sqrt() / d.abs().amax(0).double().sqrt()).float()
        folded = P[f"mlp.experts.{e}.down_proj.weight"] if family.endswith("_linear") else P["mlp.experts.down_proj"][e]
        torch.testing.assert_close(column_scale(folded, d), s2, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3", "qwen2_moe_linear"])
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_w4a4_moe_runs_end_to_end(family, method):
    model = build(family)
    ids = token_ids(4, 32)
    with torch.no_grad():
        ref = model(ids).logits
    rep = quantize_model(model, PTQConfig(method=method, activations="w4a4", calibrate_all_experts=True), ids,
                         progress=False)
    with torch.no_grad():
        out = model(ids).logits
    assert torch.isfinite(out).all()
    assert float((out - ref).square().mean() / ref.square().mean()) < 0.5
    assert all(lr.smoothing_alpha is not None for lr in rep.linears if ".mlp." in lr.name)
    assert not [w for w in rep.warnings if "not smoothed" in w]


def test_excluded_experts_are_rescaled_with_their_norm(monkeypatch):
    """Experts kept in high precision still read the smoothed norm's output: their columns carry s."""
    ids = token_ids(4, 32)
    ref = tiny_moe("qwen2_moe")
    model = copy.deepcopy(ref)
    snap = Snapshot(monkeypatch, SmoothQuant, 0)
    exclude = (*DEFAULT_EXCLUDE, r"self_attn", r"mlp\.experts")
    quantize_model(model, PTQConfig(method="smoothquant", exclude=exclude, allow_partial=True), ids, progress=False)
    f_layer, q_layer = ref.model.layers[0], model.model.layers[0]
    assert not isinstance(q_layer.mlp.experts, NVFP4Experts)
    assert isinstance(q_layer.mlp.shared_expert.gate_proj, NVFP4Linear)
    s1 = f_layer.post_attention_layernorm.weight.detach() / snap.params["post_attention_layernorm.weight"]
    assert float((s1 - 1).abs().max()) > 1e-3
    want = f_layer.mlp.experts.gate_up_proj.detach() * s1
    torch.testing.assert_close(q_layer.mlp.experts.gate_up_proj.detach(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(q_layer.mlp.experts.down_proj.detach(), f_layer.mlp.experts.down_proj.detach(),
                               rtol=0, atol=0)  # no per-expert group: nothing of them is quantized


def test_awq_with_one_outer_scale_for_all_experts(monkeypatch):
    """expert_outer_scale="tensor": the post-attention-norm search quantizes all experts' gate/up rows with
    one shared scale (one part, each expert on its own tokens)."""
    import blockscale.ptq.methods.awq as awq_mod

    seen = []
    orig = awq_mod.awq_search_parts

    def spy(parts, **kw):
        parts = list(parts)
        seen.append([len(inputs) for _, inputs in parts])
        return orig(parts, **kw)

    monkeypatch.setattr(awq_mod, "awq_search_parts", spy)
    model = tiny_moe("mixtral")
    rep = quantize_model(model, PTQConfig(method="awq", expert_outer_scale="tensor"), token_ids(4, 32), progress=False)
    assert [r.outer_scale for r in rep.experts] == ["tensor", "tensor"]
    assert seen[0] == [4] and seen[1:5] == [[1]] * 4  # layer 0: gate_up (one part, 4 inputs), then 4 downs
