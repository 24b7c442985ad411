"""AutoRound (``ptq.methods.autoround``, issue 32): the grids' forward values are what the final codes
dequantize to, bit for bit, for every format; zero iterations is round to nearest bit for bit (scale rules
6 / 4over6 / Hessian, W4A16 / W4A4, the mixed FP8 / MX recipes); one sign-SGD step against a hand-computed
gradient; learned layers never worse than round to nearest on the calibration set (checked independently
of the method's own figures); fused MoE experts (Mixtral, Qwen3-MoE, gpt-oss) learned with their layer. Export and reload of every method and setting: tests/ptq/test_qwen2_family.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from blockscale.ptq import AutoRoundOptions, PTQConfig, quantize_model
from blockscale.ptq.capture import LayerInput
from blockscale.ptq.methods.autoround import LinearLearner, batch_loss, make_grid, sign_step
from blockscale.quant import FP8, MX, NVFP4, quantize
from blockscale.recipes.ptq_builtin import get_ptq_recipe

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402
from tiny_moe import tiny_gpt_oss, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _weight(n=48, k=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row (zero block scales)
    w[1, 3] = -0.0  # a signed zero
    w[2, :16] *= 40.0  # a block far above the rest
    return w


SPECS = {
    "nvfp4-6": NVFP4(), "nvfp4-4over6": NVFP4(scale_rule="4over6"), "fp8-tensor": FP8(),
    "fp8-channel": FP8(granularity="channel"), "fp8-block": FP8(granularity="block"),
    "mxfp4": MX("e2m1"), "mxfp8-floor": MX("e4m3", "floor"), "mxfp8-e5m2": MX("e5m2"),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_fake_weight_is_what_the_final_codes_dequantize_to(name):
    w = _weight(n=160 if name == "fp8-block" else 48, k=256 if name == "fp8-block" else 64)
    q0 = quantize(w, SPECS[name])
    grid = make_grid(w, q0)
    # the start: q0's codes and scales, bit for bit, and W itself as the latent (the signed zero too)
    zero = torch.zeros_like(w)
    ones = None if grid.alpha_shape is None else torch.ones(grid.alpha_shape)
    q, latent = grid.final(zero, ones)
    assert torch.equal(_bits(q.codes), _bits(q0.codes)) and torch.equal(_bits(q.scales), _bits(q0.scales))
    assert torch.equal(_bits(latent), _bits(w))
    assert torch.equal(grid.fake(zero, ones), q0.dequantize())
    # moved: V in [-0.5, 0.5] on half the elements, alpha in [0.5, 1]
    g = torch.Generator().manual_seed(1)
    V = (torch.rand(w.shape, generator=g) - 0.5) * (torch.rand(w.shape, generator=g) < 0.5)
    alpha = None if grid.alpha_shape is None else 0.5 + 0.5 * torch.rand(grid.alpha_shape, generator=g)
    q, latent = grid.final(V, alpha)
    fake = grid.fake(V, alpha)
    assert torch.equal(fake, q.dequantize())
    assert not torch.equal(fake, q0.dequantize())
    assert torch.equal(latent == w, (V == 0) | (latent == w))  # only moved elements changed
    if alpha is not None and isinstance(SPECS[name], NVFP4):  # E4M3 block scales, never above the start
        assert bool((q.scales.float() <= q0.scales.float()).all())


class _One(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.proj = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(w)

    def forward(self, x):
        return self.proj(x)


def test_one_sign_sgd_step_against_a_hand_computed_gradient():
    w = _weight(n=8, k=32, seed=3)
    layer = _One(w)
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        target = layer(x)
    q0 = quantize(w, NVFP4())
    grid = make_grid(w, q0)
    ln = LinearLearner("proj", layer.proj, grid, True)
    layer.proj.weight.requires_grad_(False)
    loss = batch_loss(layer, [ln], LayerInput(x, (), {}), target, "cpu")
    loss.backward()
    gV, ga = ln.V.grad.clone(), ln.alpha.grad.clone()

    # by hand: L = mean((x Wq^T - x W^T)^2); dL/dWq = 2 E^T x / E.numel()
    Wq = q0.dequantize()
    x2, E = x.reshape(-1, 32), (x.reshape(-1, 32) @ Wq.T - target.reshape(-1, 8))
    assert torch.allclose(loss, E.square().mean())
    G = 2.0 * E.T @ x2 / E.numel()
    s0 = q0.scales.float()  # [8, 2]
    d = (s0 * (1.0 / q0.outer_scale)).repeat_interleave(16, dim=1)
    y = w / torch.where(d > 0, d, torch.ones_like(d))
    inside = (y.abs() <= 6.0) & (d > 0)
    gV_ref = G * grid.g * inside  # straight through the rounding, nothing outside the E2M1 range
    # d(out)/d(d) = R(y) - y inside the range (R(y) outside), d(d)/d(alpha) = s0 / S
    dd = torch.where(d > 0, Wq / torch.where(d > 0, d, torch.ones_like(d)) - torch.where(inside, y, 0.0), 0.0)
    ga_ref = (G * dd * (s0 / q0.outer_scale).repeat_interleave(16, dim=1)).reshape(8, 2, 16).sum(-1)
    assert torch.allclose(gV, gV_ref, rtol=1e-5, atol=1e-9)
    assert torch.allclose(ga, ga_ref, rtol=1e-4, atol=1e-9)
    assert int((gV != 0).sum()) > 100 and int((ga != 0).sum()) > 4

    sign_step([ln], 0.1, 0.5)
    assert ln.V.grad is None and ln.alpha.grad is None
    assert torch.equal(ln.V, -0.1 * torch.sign(gV))
    assert torch.equal(ln.alpha, torch.clamp(1.0 - 0.1 * torch.sign(ga), 0.5, 1.0))
    # a second, larger step: V and alpha clamped to [-0.5, 0.5] and [0.5, 1]
    V1, a1 = ln.V.detach().clone(), ln.alpha.detach().clone()
    batch_loss(layer, [ln], LayerInput(x, (), {}), target, "cpu").backward()
    gV2, ga2 = ln.V.grad.clone(), ln.alpha.grad.clone()
    sign_step([ln], 0.45, 0.5)
    assert torch.equal(ln.V, torch.clamp(V1 - 0.45 * torch.sign(gV2), -0.5, 0.5))
    assert torch.equal(ln.alpha, torch.clamp(a1 - 0.45 * torch.sign(ga2), 0.5, 1.0))
    assert float(ln.V.detach().abs().max()) == 0.5


def _state_bits(model) -> dict:
    return {k: _bits(v) for k, v in model.state_dict().items()}


SETTINGS = {
    "6-w4a16": dict(), "4over6-w4a4": dict(scale_rule="4over6", activations="w4a4"),
    "hessian-w4a16": dict(scale_rule="hessian"),
    "fp8-attention-nvfp4-mlp-kv": dict(recipe=get_ptq_recipe("nvfp4-experts-fp8-attention")),
    "mxfp4-w4a16": dict(recipe=get_ptq_recipe("mxfp4-w4a16")), "fp8": dict(recipe=get_ptq_recipe("fp8")),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_zero_iterations_is_round_to_nearest_bit_for_bit(setting):
    calib = token_ids(4, 16)
    base = tiny_hf_llama()
    rtn, ar = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model(rtn, PTQConfig(method="rtn", batch_size=2, **SETTINGS[setting]), calib, progress=False)
    rep = quantize_model(ar, PTQConfig(method="autoround", options=AutoRoundOptions(iters=0), batch_size=2,
                                       **SETTINGS[setting]), calib, progress=False)
    a, b = _state_bits(rtn), _state_bits(ar)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert [s["learned"] for s in rep.method_stats] == [False] * len(rep.method_stats) and rep.method_stats


def _layer0_error(model, fp_out, calib) -> float:
    got = []
    h = model.model.layers[0].register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(calib)
    h.remove()
    return float((got[0].float() - fp_out.float()).square().mean())


@pytest.mark.parametrize("activations", ["w4a16", "w4a4"])
def test_learned_layers_are_never_worse_than_round_to_nearest(activations):
    calib = token_ids(4, 16)
    base = tiny_hf_llama()
    fp_out = []
    h = base.model.layers[0].register_forward_hook(lambda m, a, o: fp_out.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        base(calib)
    h.remove()
    rtn, ar = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model(rtn, PTQConfig(method="rtn", activations=activations, batch_size=4), calib, progress=False)
    rep = quantize_model(ar, PTQConfig(method="autoround", activations=activations, batch_size=4,
                                       options=AutoRoundOptions(iters=40)), calib, progress=False)
    stats = rep.method_stats
    assert [s["layer"] for s in stats] == list(range(len(base.model.layers)))
    assert all(s["mse"] <= s["start_mse"] for s in stats)
    assert any(s["learned"] and s["mse"] < 0.9 * s["start_mse"] for s in stats), stats
    # independently of the method's figures: decoder layer 0 (the same inputs in all three models)
    e_rtn, e_ar = _layer0_error(rtn, fp_out[0], calib), _layer0_error(ar, fp_out[0], calib)
    assert e_rtn == pytest.approx(stats[0]["start_mse"], rel=1e-4)
    assert e_ar == pytest.approx(stats[0]["mse"], rel=1e-4)
    assert e_ar <= e_rtn


@pytest.mark.parametrize("family,activations", [("mixtral", "w4a16"), ("mixtral", "w4a4"), ("qwen3_moe", "w4a16"),
                                                ("gpt_oss", "w4a16"), ("gpt_oss", "w4a4")])
def test_fused_moe_experts_are_learned_with_their_layer(family, activations):
    calib = token_ids(4, 16)
    base = tiny_gpt_oss() if family == "gpt_oss" else tiny_moe(family)
    rtn, ar0, ar = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(activations=activations, batch_size=2)
    quantize_model(rtn, PTQConfig(method="rtn", **kw), calib, progress=False)
    quantize_model(ar0, PTQConfig(method="autoround", options=AutoRoundOptions(iters=0), **kw), calib, progress=False)
    rep = quantize_model(ar, PTQConfig(method="autoround", options=AutoRoundOptions(iters=30), **kw), calib,
                         progress=False)
    a, b0, b = _state_bits(rtn), _state_bits(ar0), _state_bits(ar)
    assert [k for k in a if not torch.equal(a[k], b0[k])] == []  # zero iterations: round to nearest
    experts = [k for k in a if ".experts." in k and not torch.equal(a[k], b[k])]
    assert any("gate_up" in k for k in experts) and any("down" in k for k in experts), experts
    assert all(s["mse"] <= s["start_mse"] for s in rep.method_stats) and any(s["learned"] for s in rep.method_stats)
    assert not [w for w in rep.warnings if "expert" in w and "high precision" not in w], rep.warnings
