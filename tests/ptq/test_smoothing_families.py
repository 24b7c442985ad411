"""Smoothing groups from the per-family table (blockscale.ptq.smoothing.families) on tiny models of each
dense family built from transformers configs (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3):
the groups found, folding random scales leaves the logits unchanged, AWQ / SmoothQuant PTQ end to end
(AWQ's error on the norm groups below RTN's, SmoothQuant's scales the formula's), export round trips,
and the errors for layers no family knows. MoE families: tests/ptq/test_smoothing_moe.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.errors import QuantizationError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, PTQConfig, quantize_model
from blockscale.ptq.methods import AWQ, SmoothQuant
from blockscale.ptq.methods.smoothquant import smoothquant_scales
from blockscale.ptq.smoothing import (SMOOTHING_FAMILIES, GroupRule, SmoothingGroup, WeightSlice,
                                      check_norm_absorbs_scales, find_smoothing_groups, fold_smoothing,
                                      layer_smoothing_groups, smoothing_family)

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_family as tiny, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]
GEMMAS = ("gemma", "gemma2", "gemma3")


def _expected(family: str, gqa: bool) -> list[tuple]:
    """(name, prev_name, fold, consumers) of one decoder layer: the family's table, written out."""
    if family == "phi3":
        rows = [("self_attn.qkv", "input_layernorm", "norm", ("self_attn.qkv_proj",)),
                ("self_attn.o_proj", "self_attn.qkv_proj", "rows", ("self_attn.o_proj",)),
                ("mlp.gate_up", "post_attention_layernorm", "norm", ("mlp.gate_up_proj",)),
                ("mlp.down_proj", "mlp.gate_up_proj", "rows", ("mlp.down_proj",))]
    else:
        norm = "norm_plus_one" if family in GEMMAS else "norm"
        mlp_norm = "pre_feedforward_layernorm" if family in ("gemma2", "gemma3") else "post_attention_layernorm"
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        rows = [("self_attn.qkv", "input_layernorm", norm, qkv),
                ("self_attn.o_proj", "self_attn.v_proj", "linear", ("self_attn.o_proj",)),
                ("mlp.gate_up", mlp_norm, norm, ("mlp.gate_proj", "mlp.up_proj")),
                ("mlp.down_proj", "mlp.up_proj", "linear", ("mlp.down_proj",))]
    return [r for r in rows if not (gqa and r[0] == "self_attn.o_proj")]


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_groups_of_each_family_are_its_table(family, gqa):
    model = tiny(family, n_kv=2 if gqa else 4)
    for layer in model.model.layers:
        groups = find_smoothing_groups(layer)
        assert [(g.name, g.prev_name, g.fold, g.linear_names) for g in groups] == _expected(family, gqa)
        assert layer_smoothing_groups(layer) == (groups, [])
        for g in groups:  # the objects are the layer's modules
            assert all(m is layer.get_submodule(n) for m, n in zip(g.linears, g.linear_names))
            assert g.prev_module is layer.get_submodule(g.prev_name)
            assert g.norm_offset == (1.0 if g.fold == "norm_plus_one" else 0.0)
        if family == "phi3":  # the value rows of qkv_proj [q | k | v], the up half of gate_up_proj [gate | up]
            qkv, gu = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
            by = {g.name: g for g in groups}
            if not gqa:
                assert by["self_attn.o_proj"].prev.rows == (128, 192) and qkv.shape[0] == 192
                assert by["self_attn.o_proj"].prev.tensor().data_ptr() == qkv[128:].data_ptr()
            assert by["mlp.down_proj"].prev.rows == (128, 256) and gu.shape[0] == 256
            assert by["mlp.down_proj"].prev.tensor().data_ptr() == gu[128:].data_ptr()
    assert smoothing_family(model.model.layers[0]).name == {"mistral": "llama", "qwen2": "llama",
                                                            "qwen3": "llama"}.get(family, family)


def _random_scales(K: int, seed: int, spread: float) -> torch.Tensor:
    """Positive scales log-uniform over 10^-spread .. 10^spread."""
    g = torch.Generator().manual_seed(seed)
    return 10.0 ** (spread * (2 * torch.rand(K, generator=g) - 1))


def _fold_all(model, seed: int, spread: float) -> None:
    for i, layer in enumerate(model.model.layers):
        for j, grp in enumerate(find_smoothing_groups(layer)):
            fold_smoothing(grp, _random_scales(grp.in_features, seed + 10 * i + j, spread))


@pytest.mark.parametrize("family", FAMILIES)
def test_folding_random_scales_keeps_the_logits(family):
    model = tiny(family)
    with torch.no_grad():  # larger-than-default weights: O(1) activations, so the check is not trivially tight
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    ref = copy.deepcopy(model)
    ids = token_ids(2, 24, seed=3)
    with torch.no_grad():
        before = model(ids).logits
    # scales over 1e-2 .. 1e2, as test_smoothing.py; the weights really change
    _fold_all(model, 100, 2.0)
    with torch.no_grad():
        after = model(ids).logits
    rel = float((after - before).abs().max() / before.abs().max())
    assert float(before.abs().max()) > 1.0
    # fp32: W * s, w / s and rows / s round to 2^-24 relative each: measured <= 1e-6 through 2 layers. Gemma's
    # (1 + w) / s - 1 stores weight' with an absolute error of 2^-24 |weight'|, i.e. 2^-24 |g' - 1| / g' relative
    # to the gain g' = (1 + w) / s: up to 2^-24 * 0.5 * 1e2 / 0.5 ~ 6e-6 here (gains >= 0.5, s <= 1e2)
    tol = 1e-4 if family in GEMMAS else 1e-5
    assert rel < tol, rel
    for (n, p), p0 in zip(model.named_parameters(), ref.parameters()):
        if n.endswith("input_layernorm.weight"):
            assert float((p - p0).detach().abs().max()) > 1.0, n


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_the_fold_kinds_are_needed(family):
    """Without the family's own fold the model changes: a Gemma norm divided like a plain norm, Phi-3's
    gate_up_proj divided on all its rows instead of the up rows only (the test can fail)."""
    model = tiny(family)
    ids = token_ids(2, 24, seed=3)
    with torch.no_grad():
        before = model(ids).logits
    layer = model.model.layers[0]
    groups = find_smoothing_groups(layer)
    s = _random_scales(groups[0].in_features, 1, 1.0)
    if family == "gemma3":
        with pytest.raises(NotImplementedError, match=r"Gemma3RMSNorm.*1 \+ weight"):
            fold_smoothing(SmoothingGroup("g", layer.input_layernorm, groups[0].linears, groups[0].linear_names), s)
        with torch.no_grad():  # what that fold would do: weight / s
            layer.input_layernorm.weight.div_(s)
            for lin in groups[0].linears:
                lin.weight.mul_(s)
    else:
        down = groups[-1]
        s = _random_scales(down.in_features, 1, 1.0)
        with torch.no_grad():  # 1 / s on the gate rows too: act(gate / s) != act(gate) / s
            gu = layer.mlp.gate_up_proj.weight
            gu.copy_(gu / torch.cat([s, s])[:, None])
            layer.mlp.down_proj.weight.mul_(s)
    with torch.no_grad():
        rel = float((model(ids).logits - before).abs().max() / before.abs().max())
    assert rel > 1e-2, rel


def test_gemma_norm_probe_and_offset():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gn, rn = Gemma3RMSNorm(32), nn.RMSNorm(32)
    with torch.no_grad():
        gn.weight.uniform_(-0.5, 0.5)
    w0 = gn.weight.detach().clone()
    check_norm_absorbs_scales(gn, 1.0)
    assert torch.equal(gn.weight, w0)  # restored bit for bit
    with pytest.raises(NotImplementedError, match="1 \\+ weight"):
        check_norm_absorbs_scales(gn)
    with pytest.raises(NotImplementedError, match=r"RMSNorm: scaling \(1 \+ weight\) does not scale its output"):
        check_norm_absorbs_scales(rn, 1.0)
    lin = nn.Linear(32, 8)
    for bad in (float("nan"), True, "1"):
        with pytest.raises(ValueError, match="norm_offset"):
            SmoothingGroup("g", gn, (lin,), ("l",), norm_offset=bad)
    with pytest.raises(ValueError, match="norm_offset applies to a norm prev only"):
        SmoothingGroup("g", nn.Linear(8, 32), (lin,), ("l",), norm_offset=1.0)
    # the fold: weight' = (1 + w) / s - 1, so (1 + weight') = (1 + w) / s up to fp32 rounding
    grp = SmoothingGroup("g", gn, (lin,), ("l",), norm_offset=1.0)
    s = _random_scales(32, 0, 1.0)
    x = torch.randn(5, 32)
    with torch.no_grad():
        y0 = lin(gn(x))
        fold_smoothing(grp, s)
        assert torch.allclose(1 + gn.weight, (1 + w0) / s, rtol=1e-6, atol=0)
        assert torch.allclose(lin(gn(x)), y0, rtol=1e-5, atol=1e-5)


def test_weight_slice_prev_validation():
    qkv, o = nn.Linear(16, 24), nn.Linear(8, 16)
    SmoothingGroup("o", WeightSlice(qkv, rows=(16, 24)), (o,), ("o",))
    with pytest.raises(ValueError, match="8 output rows|holds 4 output rows"):
        SmoothingGroup("o", WeightSlice(qkv, rows=(16, 20)), (o,), ("o",))
    with pytest.raises(ValueError, match="output rows of an nn.Linear"):
        SmoothingGroup("o", WeightSlice(qkv, rows=(16, 24), transposed=True), (o,), ("o",))
    # the rows and their bias entries are divided, nothing else
    g = SmoothingGroup("o", WeightSlice(qkv, rows=(16, 24)), (o,), ("o",))
    w0, b0 = qkv.weight.detach().clone(), qkv.bias.detach().clone()
    s = torch.full((8,), 4.0)
    fold_smoothing(g, s)
    assert torch.equal(qkv.weight[:16], w0[:16]) and torch.equal(qkv.bias[:16], b0[:16])
    assert torch.equal(qkv.weight[16:], w0[16:] / 4) and torch.equal(qkv.bias[16:], b0[16:] / 4)


def test_table_rules_are_checked():
    with pytest.raises(ValueError, match="fold='gemma'; allowed: norm, norm_plus_one, linear"):
        GroupRule("g", "n", ("a",), "gemma")
    with pytest.raises(ValueError, match="rows"):
        GroupRule("g", "n", ("a",), "norm", rows=(0, 2))
    classes = [c for f in SMOOTHING_FAMILIES for c in f.layer_classes]
    assert len(classes) == len(set(classes))
    assert {f.name for f in SMOOTHING_FAMILIES} >= {"llama", "gemma2", "gemma3", "phi3", "moe"}


# ---- AWQ / SmoothQuant end to end -------------------------------------------------------------------------

class Snapshot:
    """Layer 0's parameters right after the method folded its scales (before RTN)."""

    def __init__(self, monkeypatch, cls):
        self.params = None
        orig = cls.transform_layer

        def spy(method, ctx):
            out = orig(method, ctx)
            if ctx.index == 0:
                self.params = {n: p.detach().float().clone() for n, p in ctx.module.named_parameters()}
            return out

        monkeypatch.setattr(cls, "transform_layer", spy)


def _norm_inputs(model, ids):
    """Layer 0's norm-group inputs in the full-precision model: {norm path: [T, 64]}."""
    layer, got = model.model.layers[0], {}
    hs = [layer.get_submodule(g.prev_name).register_forward_hook(
        lambda m, a, o, n=g.prev_name: got.__setitem__(n, o.detach().reshape(-1, o.shape[-1]).float()))
        for g in find_smoothing_groups(layer) if g.fold.startswith("norm")]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    return got


def _weight(m):
    return m.dequantized_weight(torch.float32) if isinstance(m, NVFP4Linear) else m.weight.detach().float()


def _group_error(x, groups, quantized_layer, folded, s, row_scale):
    """Sum over the group's consumers of ||(x / s) Q^T / r - x W^T||^2: the quantized outputs in the original
    coordinates (r: the later group's 1 / s2 on rows that feed it, recovered from the snapshot)."""
    err = 0.0
    for name, w_ref in groups:
        q = _weight(quantized_layer.get_submodule(name)).detach()
        r = row_scale.get(name, torch.ones(q.shape[0]))
        err += float(((x / s) @ q.T / r - x @ w_ref.T).double().square().sum())
    return err


W4A16 = dict(n_samples=8, seq_len=32, batch_size=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_error_on_the_norm_groups_below_rtn(family, monkeypatch):
    """Layer 0 (its inputs are the embeddings in every run): for each norm group, the quantized consumers'
    output error on the calibration tokens, in the original coordinates, is below RTN's. GQA models (no
    v -> o group): only the up rows of gate/up are divided again by a later group (up -> down)."""
    ref = tiny(family, n_kv=2)
    ids = token_ids(8, 32)
    xs = _norm_inputs(ref, ids)
    rtn, awq = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(rtn, PTQConfig(method="rtn", **W4A16), ids, progress=False)
    snap = Snapshot(monkeypatch, AWQ)
    rep = quantize_model(awq, PTQConfig(method="awq", **W4A16), ids, progress=False)
    assert any(lr.smoothing_alpha for lr in rep.linears)
    f0, r0, a0 = (m.model.layers[0] for m in (ref, rtn, awq))
    groups = find_smoothing_groups(f0)
    P = snap.params
    # the up -> down group's scales s2 (down's columns times s2) divide the up rows of the final weights
    down = groups[-1]
    d_name = down.linear_names[0]
    s2 = P[f"{d_name}.weight"].abs().sum(0) / f0.get_submodule(d_name).weight.detach().abs().sum(0)
    up = down.prev_name
    n_up = f0.get_submodule(up).weight.shape[0]
    up_scale = torch.cat([torch.ones(n_up - s2.numel()), 1 / s2]) if family == "phi3" else 1 / s2
    improved = 0
    for g in groups:
        if not g.fold.startswith("norm"):
            continue
        c = g.norm_offset
        w_ref = f0.get_submodule(g.prev_name).weight.detach().float()
        s = (c + w_ref) / (c + P[f"{g.prev_name}.weight"])  # the norm's gain divided by s
        consumers = [(n, f0.get_submodule(n).weight.detach().float()) for n in g.linear_names]
        rows = {up: up_scale} if up in g.linear_names else {}
        e_awq = _group_error(xs[g.prev_name], consumers, a0, P, s, rows)
        e_rtn = _group_error(xs[g.prev_name], consumers, r0, P, torch.ones_like(s), {})
        assert e_awq <= e_rtn * (1 + 1e-5), (g.name, e_awq, e_rtn)
        improved += e_awq < e_rtn * 0.99
    assert improved == 2, improved  # both norm groups: attention and MLP


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothquant_runs_and_its_scales_are_the_formula(family, monkeypatch):
    ref = tiny(family)
    ids = token_ids(8, 32)
    xs = _norm_inputs(ref, ids)
    model = copy.deepcopy(ref)
    snap = Snapshot(monkeypatch, SmoothQuant)
    rep = quantize_model(model, PTQConfig(method="smoothquant", **W4A16), ids, progress=False)
    assert {lr.smoothing_alpha for lr in rep.linears} == {0.5}
    f0 = ref.model.layers[0]
    for g in find_smoothing_groups(f0):
        if not g.fold.startswith("norm"):
            continue
        c = g.norm_offset
        w_ref = f0.get_submodule(g.prev_name).weight.detach().float()
        s = (c + w_ref) / (c + snap.params[f"{g.prev_name}.weight"])
        want = smoothquant_scales(xs[g.prev_name].abs().amax(0), [m.weight for m in g.linears], 0.5)
        # s recovered from the folded fp32 norm: 2^-24 relative each way; Gemma's (1 + w) form ~1e-6
        assert torch.allclose(s, want, rtol=1e-4), (g.name, float((s / want - 1).abs().max()))
    with torch.no_grad():
        assert torch.isfinite(model(token_ids(2, 24, seed=5)).logits).all()


@pytest.mark.parametrize("family,fmt", [("gemma3", "compressed-tensors"), ("gemma2", "modelopt"),
                                        ("phi3", "compressed-tensors"), ("phi3", "modelopt")])
def test_awq_export_round_trips_bit_for_bit(family, fmt, tmp_path):
    model = tiny(family)
    quantize_model(model, PTQConfig(method="awq", options=AWQOptions(grid=5), **W4A16), token_ids(8, 32),
                   progress=False)
    probe = token_ids(2, 24, seed=5)
    with torch.no_grad():
        logits = model(probe).logits
    back = bs.load(bs.export_checkpoint(model, tmp_path / fmt, fmt))
    assert type(back).__name__ == type(model).__name__
    with torch.no_grad():
        assert torch.equal(back(probe).logits, logits)
    n0 = model.model.layers[0].input_layernorm.weight
    assert torch.equal(back.model.layers[0].input_layernorm.weight, n0)  # the folded norm


# ---- layers no family knows --------------------------------------------------------------------------------

class MyDecoderLayer(nn.Module):
    """Gemma 2's modules under a class no family lists: its sandwich norms are not Llama's dataflow."""

    def __init__(self, layer):
        super().__init__()
        for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            setattr(self, n, getattr(layer, n))


def test_unknown_layer_class_names_it():
    layer = MyDecoderLayer(tiny("gemma2").model.layers[0])
    for fn in (find_smoothing_groups, layer_smoothing_groups):
        with pytest.raises(NotImplementedError) as info:
            fn(layer)
        msg = str(info.value)
        assert msg.startswith("find_smoothing_groups: MyDecoderLayer is not a supported decoder layer (no smoothing "
                              "family lists the class MyDecoderLayer; family 'llama'"), msg
        assert "parameter 'pre_feedforward_layernorm.weight' belongs to no module" in msg
        assert "Gemma2DecoderLayer" in msg and "SmoothingGroup(name, prev, linears" in msg
    assert "MoE / MLA layout" in msg  # layer_smoothing_groups also tried the MoE layout
    # an unlisted class with exactly Llama's modules is still smoothed (matched by structure)
    llama = tiny("llama").model.layers[0]
    layer = MyDecoderLayer.__new__(MyDecoderLayer)
    nn.Module.__init__(layer)
    for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        setattr(layer, n, getattr(llama, n))
    assert [g.name for g in find_smoothing_groups(layer)] == [r[0] for r in _expected("llama", False)]


def test_listed_class_with_a_foreign_norm_is_refused():
    layer = tiny("gemma3").model.layers[0]
    layer.pre_feedforward_layernorm = nn.RMSNorm(64)
    with pytest.raises(NotImplementedError, match=r"find_smoothing_groups\(Gemma3DecoderLayer\): RMSNorm: scaling "
                                                  r"\(1 \+ weight\) does not scale"):
        find_smoothing_groups(layer)
    mixtral = SMOOTHING_FAMILIES[-1]
    assert mixtral.moe and "MixtralDecoderLayer" in mixtral.layer_classes


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_ptq_on_an_unknown_layer_names_it_before_calibration(method, monkeypatch):
    import importlib

    qm = importlib.import_module("blockscale.ptq.quantize_model")  # the module (the package exports the function)

    def refuse(*_a, **_k):
        raise AssertionError("the model was run on calibration data before the error")

    monkeypatch.setattr(qm, "capture_first_layer_inputs", refuse)
    model = tiny("gemma2")
    model.model.layers = nn.ModuleList([MyDecoderLayer(layer) for layer in model.model.layers])
    with pytest.raises(QuantizationError, match=r"^model\.layers\.0: method='%s' cannot smooth this layer: "
                                                r"find_smoothing_groups: MyDecoderLayer is not a supported" % method):
        quantize_model(model, PTQConfig(method=method), token_ids(4, 16), progress=False)
