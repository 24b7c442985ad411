"""Rotations on MoE decoder layers (blockscale.ptq.rotations.experts): R1 / R2 fused into the router, every routed
expert (fused 3-D layouts: standard [E, 2I, H] / [E, H, I] and gpt-oss's transposed one with biases; the per-expert
nn.Linear layout of transformers 4), the shared expert and Qwen2-MoE's shared_expert_gate keep the full-precision
logits within FP32 rounding and every routing decision; online rotations (R4, mr, quip) rotate only the dense
Linears and list the routed experts as unrotated; MLA (DeepSeek-V3) and unknown layouts refused before any weight
changes; PTQ (RTN, GPTQ) with r1r2 on MoE models, export and ``bs.load`` bit for bit; AWQ leaves the MoE norm group
unsmoothed when the shared expert's inputs are rotated online."""
from __future__ import annotations

import copy
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.errors import QuantizationError
from blockscale.export import export_checkpoint
from blockscale.nn.input_rotation import input_rotations
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.rotations import parse_rotate, rotate_model
from blockscale.quant import NVFP4
from blockscale.quant.transforms.rotation import rotation

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import tiny_deepseek, tiny_gpt_oss, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 16, seed=3)
CALIB = token_ids(8, 32, seed=0)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "mixtral_linear", "qwen2_moe_linear"]
ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


class _Expert(nn.Module):
    """One expert of the transformers-4 layout: down(act(gate(x)) * up(x)) of nn.Linear."""

    def __init__(self, gate_up, down, act, names):
        super().__init__()
        self.names, self.act_fn, half = names, act, gate_up.shape[0] // 2
        for n, w in zip(names, (gate_up[:half], gate_up[half:], down)):
            setattr(self, n, nn.Linear(w.shape[1], w.shape[0], bias=False))
            getattr(self, n).weight.data.copy_(w)

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class _LinearExperts(nn.ModuleList):
    """The per-expert nn.Linear layout with a fused experts module's weights and the transformers eager loop."""

    def __init__(self, fused, names):
        super().__init__([_Expert(gu, dn, fused.act_fn, names)
                          for gu, dn in zip(fused.gate_up_proj.detach(), fused.down_proj.detach())])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
        for e, expert in enumerate(self):
            pos, tok = torch.where(mask[e])
            if tok.numel():
                out.index_add_(0, tok, expert(hidden_states[tok]) * top_k_weights[tok, pos, None])
        return out


def build(family: str):
    """A tiny MoE model with non-trivial norms (gains 0.5 .. 1.5, four channels x8) and biases (attention, the
    gpt-oss router), as the dense rotation tests' ``tiny_family``."""
    if family == "gpt_oss":
        model = tiny_gpt_oss()
    elif family.endswith("_linear"):
        model = tiny_moe(family[:-len("_linear")])
        names = ("w1", "w3", "w2") if family.startswith("mixtral") else ("gate_proj", "up_proj", "down_proj")
        for layer in model.model.layers:
            layer.mlp.experts = _LinearExperts(layer.mlp.experts, names)
    else:
        model = tiny_moe(family)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                gain = 0.5 + torch.rand(m.weight.shape, generator=g)
                gain[torch.randperm(gain.numel(), generator=g)[:4]] *= 8.0
                m.weight.copy_(gain)
        for name, p in model.named_parameters():
            if name.endswith("bias") and ".experts." not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _router(mlp):
    return getattr(mlp, "router", None) or mlp.gate


def _run(model, ids=IDS):
    """(logits, each router's logits, each router's chosen experts per token, sorted)."""
    routers, picks, handles = [], [], []

    def hook(module, args, out):  # (router logits, scores, chosen experts)
        routers.append(out[0].detach().clone())
        picks.append(out[-1].sort(-1).values)

    for layer in model.model.layers:
        handles.append(_router(layer.mlp).register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits, routers, picks


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _same_function(model, ref, what):
    logits, routers, picks = _run(model)
    assert _rel(logits, ref[0]) < 1e-5, what  # FP64 folds, one FP32 rounding per weight (a wrong fold: O(1))
    assert len(routers) == len(ref[1]) == 2
    for a, b in zip(routers, ref[1]):
        assert _rel(a, b) < 1e-5, what  # the router's logits: unchanged up to rounding
    assert all(torch.equal(a, b) for a, b in zip(picks, ref[2])), what  # every token: the same experts


@pytest.mark.parametrize("family", FAMILIES)
def test_r1r2_keeps_logits_and_routing(family):
    model = build(family)
    ref = _run(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = rotate_model(model, parse_rotate("r1r2", seed=5))
    _same_function(model, ref, report.lines())
    assert report.skipped == [] and not input_rotations(model)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    for i, layer in enumerate(model.model.layers):  # every router / expert / shared expert weight was rotated
        for n, _ in layer.mlp.named_parameters():
            full = f"model.layers.{i}.mlp.{n}"
            if n in ("router.bias", "experts.gate_up_proj_bias"):  # input side: (x Q)(Q^T W) + b
                assert full not in changed, full
            else:
                assert full in changed, full
    norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")
             and not n.endswith(("q_norm", "k_norm"))]
    assert len(norms) == 5 and all(bool((m.weight == 1).all()) for m in norms)  # every norm weight folded away


def _fp64_rms_norm(self, x):  # transformers' RMSNorms compute in FP32 whatever the dtype
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("family", FAMILIES)
def test_r1r2_is_exact_in_float64(family):
    """The folds are exact algebra: in FP64 (norms too) the logits move by FP64 rounding only."""
    model = build(family).double()
    model.config._experts_implementation = "eager"  # grouped_mm has no float64
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_fp64_rms_norm, m)
    ref = _run(model)
    rotate_model(model, parse_rotate("r1r2", seed=5))
    logits, routers, picks = _run(model)
    assert _rel(logits, ref[0]) < 1e-12 and all(_rel(a, b) < 1e-12 for a, b in zip(routers, ref[1]))
    assert all(torch.equal(a, b) for a, b in zip(picks, ref[2]))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_r1_folds_each_expert_layout_along_the_hidden_dim(family):
    """W[e] <- diag(g) W[e] Q1 on the hidden dim wherever it sits: gate_up [E, 2I, H] columns / gpt-oss's
    [E, H, 2I] rows; down's hidden rows [E, H, I] / gpt-oss's columns [E, I, H] and its bias b Q1."""
    model = build(family)
    layer = model.model.layers[1]
    ex, gain = layer.mlp.experts, layer.post_attention_layernorm.weight.detach().double()
    gu, dn = ex.gate_up_proj.detach().double().clone(), ex.down_proj.detach().double().clone()
    rotate_model(model, parse_rotate("r1", seed=5))
    q = rotation("random-hadamard", 64, 5).matrix()
    for e in range(gu.shape[0]):
        if family == "gpt_oss":
            want_gu, want_dn = q.T @ (gain[:, None] * gu[e]), dn[e] @ q
        else:
            want_gu, want_dn = (gu[e] * gain) @ q, q.T @ dn[e]
        assert torch.allclose(ex.gate_up_proj[e].double(), want_gu, atol=1e-6, rtol=0)
        assert torch.allclose(ex.down_proj[e].double(), want_dn, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rotate", ["r4", "mr", "r1r2+quip"])
def test_online_rotations_leave_routed_experts_unrotated(family, rotate):
    model = build(family)
    ref = _run(model)
    schemes = {n: SimpleNamespace(weight_spec=NVFP4()) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = rotate_model(model, parse_rotate(rotate, seed=5), schemes)
    _same_function(model, ref, report.lines())
    shared = family.startswith("qwen2_moe")
    want = ("mlp.shared_expert.down_proj",) if shared else ()
    if rotate != "r4":
        want = ATTN + (SHARED if shared else ())
    assert set(input_rotations(model)) == {f"model.layers.{i}.{n}" for i in range(2) for n in want}
    experts = [s for s in report.skipped if "routed experts stay unrotated online" in s]
    assert [s.split(" ")[0] for s in experts] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    gates = [s.split(" ")[0] for s in report.skipped if "never rotated online" in s]
    assert gates == ([f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)] if shared and rotate != "r4"
                     else [])
    assert any(line.startswith("  unrotated model.layers.1.mlp.experts") for line in report.lines())


@pytest.mark.parametrize("rotate", ["r1r2", "r4", "quip"])
def test_deepseek_mla_is_refused_and_left_untouched(rotate):
    model = tiny_deepseek()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError, match=r"model\.layers\.0: rotations do not support MLA attention "
                                                r"\(DeepseekV3DecoderLayer: self_attn\.kv_a_proj_with_mqa"):
        rotate_model(model, parse_rotate(rotate))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not input_rotations(model)


def test_unknown_moe_layout_is_refused_before_any_weight_changes():
    model = build("mixtral")
    ex = model.model.layers[1].mlp.experts  # layer 0 is fine: it must not be rotated either
    ex.down_proj_bias = nn.Parameter(torch.randn(ex.down_proj.shape[0], ex.down_proj.shape[1]))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError, match=r"model\.layers\.1: rotations need an MoE layer of a known layout"):
        rotate_model(model, parse_rotate("r1r2r4"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_rtn_r1r2_exports_and_reloads_bit_for_bit(tmp_path, family):
    model = build(family)
    ref = _run(model)[0]
    report = quantize_model(model, PTQConfig(rotate="r1r2"), CALIB, progress=False)
    assert report.rotation[0] == "rotate r1r2:" and any("R1 random-hadamard 64" in s for s in report.rotation)
    logits = _run(model)[0]
    assert bool(torch.isfinite(logits).all()) and _rel(logits, ref) < 0.5
    out = export_checkpoint(model, tmp_path / "ck")
    back = bs.load(out)
    assert torch.equal(_run(back)[0], logits)


def test_gptq_r1r2_on_mixtral_runs():
    model = build("mixtral")
    ref = _run(model)[0]
    report = quantize_model(model, PTQConfig(method="gptq", rotate="r1r2"), CALIB, progress=False)
    assert report.rotation[0] == "rotate r1r2:"
    logits = _run(model)[0]
    assert bool(torch.isfinite(logits).all()) and _rel(logits, ref) < 0.5


def test_awq_does_not_smooth_the_moe_norm_group_whose_shared_expert_is_rotated_online():
    model = build("qwen2_moe")
    with pytest.warns(RuntimeWarning, match=r"mlp\.gate_up: not smoothed \(its Linears' inputs are rotated online\)"):
        quantize_model(model, PTQConfig(method="awq", rotate="quip"), CALIB, progress=False)
    assert bool(torch.isfinite(_run(model)[0]).all())
