"""Mixture of Experts: routing, the load-balancing loss, grouped experts vs a per-token loop,
per-expert NVFP4 outer scales, empty experts, model integration, conversion and training."""
import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from blockscale import NVFP4, dequantize, quantize
from blockscale.models import PRESETS, Llama, LlamaConfig
from blockscale.models.llama import FeedForward
from blockscale.nn import GroupedExperts, MoE, MoEConfig, QuantizedLinear, Router, convert, quantized_linear, unconvert
from blockscale.nn.moe import combine, dispatch
from blockscale.recipes import get_recipe
from blockscale.recipes.recipe import DEFAULT_EXCLUDE
from blockscale.train import TokenData, TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

NVFP4_RECIPE = get_recipe("nvfp4-nvidia").linear


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _moe(d=32, d_ff=48, seed=0, recipe=None, **cfg):
    torch.manual_seed(seed)
    return MoE(d, d_ff, MoEConfig(**{"n_experts": 4, "top_k": 2, **cfg}), recipe)


def _naive_route(router: Router, x2d):
    """Per token: softmax, the k largest by a full sort, renormalised weights.
    -> experts [T, k], weights [T, k], probs [T, E]."""
    rows, probs = [], []
    for t in range(x2d.shape[0]):
        p = F.linear(x2d[t:t + 1].float(), router.weight.float()).softmax(-1)[0]
        vals, idx = p.sort(descending=True)
        vals, idx = vals[:router.top_k], idx[:router.top_k]
        w = vals / vals.sum() if router.normalize_top_k else vals
        rows.append((idx, w))
        probs.append(p)
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), torch.stack(probs)


def _naive_aux(router: Router, experts, probs):
    T, E, k = probs.shape[0], router.n_experts, router.top_k
    f = torch.stack([(experts == e).sum() for e in range(E)]).float() / (T * k)
    return router.aux_loss_coef * E * (f * probs.mean(0)).sum()


def _swiglu(x, w1, w2, w3):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _naive_moe(moe: MoE, x):
    """A loop over tokens, then over each token's k experts: the definition."""
    d = x.shape[-1]
    x2d = x.reshape(-1, d)
    experts, weights, probs = _naive_route(moe.router, x2d)
    ex = moe.experts
    out = []
    for t in range(x2d.shape[0]):
        y = sum(weights[t, j] * _swiglu(x2d[t], ex.w1[e], ex.w2[e], ex.w3[e])
                for j, e in enumerate(experts[t].tolist()))
        if moe.shared_expert is not None:
            y = y + moe.shared_expert(x2d[t])
        out.append(y)
    return torch.stack(out).view_as(x), _naive_aux(moe.router, experts, probs)


# ----------------------------------------------------------------------------- config

def test_bad_config_values_raise():
    for bad, field in ((dict(n_experts=0), "n_experts"), (dict(top_k=0), "top_k"),
                       (dict(n_experts=4, top_k=5), "top_k"),
                       (dict(d_ff=-1), "d_ff"), (dict(d_ff=1.5), "d_ff"), (dict(shared_expert=1), "shared_expert"),
                       (dict(normalize_top_k="yes"), "normalize_top_k"), (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
                       (dict(aux_loss_coef=float("nan")), "aux_loss_coef"), (dict(n_experts=True), "n_experts")):
        with pytest.raises(ValueError, match=field):
            MoEConfig(**bad)
    with pytest.raises(ValueError, match="moe_every"):
        LlamaConfig(moe=MoEConfig(), moe_every=0)
    with pytest.raises(ValueError, match="moe_every"):
        LlamaConfig(n_layers=2, moe=MoEConfig(), moe_every=3)
    with pytest.raises(ValueError, match="moe"):
        LlamaConfig(moe="mixtral")
    assert LlamaConfig(moe={"n_experts": 4}).moe == MoEConfig(n_experts=4)
    for bad in (dict(first_expert=-1), dict(first_expert=3, n_local=2), dict(n_local=0)):
        with pytest.raises(ValueError, match="GroupedExperts"):
            GroupedExperts(4, 8, 16, **bad)
    ge = GroupedExperts(4, 8, 16)
    with pytest.raises(ValueError, match="counts"):
        ge(torch.zeros(3, 8), torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match="partition"):
        ge(torch.zeros(3, 8), torch.tensor([1, 1, 0, 0]))


# ----------------------------------------------------------------------------- router

@pytest.mark.parametrize("normalize", [True, False])
def test_router_top_k_and_weights_match_per_token_reference(normalize):
    torch.manual_seed(0)
    router = Router(16, MoEConfig(n_experts=6, top_k=3, normalize_top_k=normalize))
    x = _randn(40, 16, seed=1)
    plan, _ = router(x)
    experts, weights, _ = _naive_route(router, x)
    T, k = 40, 3
    assert plan.counts.tolist() == torch.bincount(experts.reshape(-1), minlength=6).tolist()
    slot_expert = torch.repeat_interleave(torch.arange(6), plan.counts)
    assert torch.equal(plan.token, plan.order // k)
    t, j = plan.order // k, plan.order % k
    assert torch.equal(experts[t, j], slot_expert)
    torch.testing.assert_close(plan.weight, weights[t, j], rtol=1e-6, atol=1e-7)  # per-row vs batched GEMM
    assert plan.weight.dtype == torch.float32 and sorted(plan.order.tolist()) == list(range(T * k))
    # stable: within each expert the slots keep token order
    for e in range(6):
        toks = plan.token[slot_expert == e]
        assert torch.equal(toks, toks.sort().values)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T))


def test_router_is_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    router = Router(16, MoEConfig())
    x = _randn(32, 16, seed=2)
    ref, _ = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan, aux = router(x)
    assert torch.equal(plan.order, ref.order) and torch.equal(plan.weight, ref.weight)
    assert plan.weight.dtype == aux.dtype == torch.float32


def test_aux_loss_hand_computed():
    torch.manual_seed(0)
    router = Router(16, MoEConfig(n_experts=5, top_k=2, aux_loss_coef=0.03))
    x = _randn(30, 16, seed=3)
    plan, aux = router(x)
    experts, _, probs = _naive_route(router, x)
    torch.testing.assert_close(aux, _naive_aux(router, experts, probs))
    # against the formula written out by hand, for the counts the router reports
    f = [c / 60 for c in plan.counts.tolist()]
    P = probs.mean(0).tolist()
    assert math.isclose(aux.item(), 0.03 * 5 * sum(fe * pe for fe, pe in zip(f, P)), rel_tol=1e-6)
    # its gradient flows through the mean probabilities P_e only
    aux.backward()
    g = router.weight.grad.clone()
    router.weight.grad = None
    _naive_aux(router, experts, _naive_route(router, x)[2]).backward()
    torch.testing.assert_close(g, router.weight.grad)


def test_aux_loss_balanced_and_collapsed():
    """Balanced (f_e = P_e = 1/E): aux = coef * E * E * (1/E)^2 = coef (whatever top_k, since the
    f_e are fractions of the T*k assignments). Every token on the same k experts with probability
    1/k each: aux = coef * E * k * (1/k)^2 = coef * E / k."""
    E, k, coef = 4, 2, 0.01
    router = Router(E, MoEConfig(n_experts=E, top_k=k, aux_loss_coef=coef))
    base = torch.tensor([3.0, 2.0, 0.0, -1.0])
    with torch.no_grad():  # token t = one-hot e_t; its logits are ``base`` rotated by t
        router.weight.copy_(torch.stack([base.roll(t) for t in range(E)], dim=1))
    plan, aux = router(torch.eye(E))
    assert plan.counts.tolist() == [2, 2, 2, 2]
    torch.testing.assert_close(aux, torch.tensor(coef), rtol=1e-6, atol=0)

    with torch.no_grad():
        router.weight.copy_(torch.tensor([[30.0] * E, [30.0] * E, [-30.0] * E, [-30.0] * E]))
    plan, aux = router(torch.eye(E))
    assert plan.counts.tolist() == [4, 4, 0, 0]
    torch.testing.assert_close(aux, torch.tensor(coef * E / k), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- MoE vs the definition

@pytest.mark.parametrize("shared", [False, True])
def test_moe_forward_and_grads_match_per_token_loop(shared):
    moe = _moe(shared_expert=shared, n_experts=5, top_k=2)
    x = _randn(2, 7, 32, seed=4).requires_grad_()
    r = _randn(2, 7, 32, seed=5)
    y = moe(x)
    (y * r).sum().add(moe.aux_loss).backward()
    got = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx = x.grad.clone()

    moe.zero_grad(set_to_none=True)
    x.grad = None
    y_ref, aux_ref = _naive_moe(moe, x)
    (y_ref * r).sum().add(aux_ref).backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.aux_loss, aux_ref)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert y.shape == x.shape and moe.aux_loss.requires_grad


def test_dispatch_experts_combine_are_the_forward():
    moe = _moe(shared_expert=True)
    x = _randn(3, 5, 32, seed=6)
    x2d = x.reshape(-1, 32)
    plan, aux = moe.router(x2d)
    staged = combine(moe.experts(dispatch(x2d, plan), plan.counts), plan, 15) + moe.shared_expert(x2d)
    assert torch.equal(moe(x), staged.view_as(x)) and torch.equal(moe.aux_loss, aux)


def test_expert_parallel_slice_equals_the_full_module():
    torch.manual_seed(0)
    full = GroupedExperts(4, 16, 24)
    part = GroupedExperts(4, 16, 24, first_expert=2, n_local=2)
    assert part.w1.shape == (2, 24, 16) and part.w2.shape == (2, 16, 24)
    with torch.no_grad():
        for n in ("w1", "w2", "w3"):
            getattr(part, n).copy_(getattr(full, n)[2:])
    counts = torch.tensor([3, 1, 4, 2])
    x = _randn(10, 16, seed=7)
    assert torch.equal(part(x[4:], counts[2:]), full(x, counts)[4:])


# ----------------------------------------------------------------------------- quantized experts

def _per_expert_reference(ge, x, counts, recipe):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        start += n
        if n:
            h = F.silu(quantized_linear(xe, ge.w1[e], None, recipe)) * quantized_linear(xe, ge.w3[e], None, recipe)
            out.append(quantized_linear(h, ge.w2[e], None, recipe))
    return torch.cat(out)


def test_quantized_experts_equal_per_expert_quantized_linear_bit_for_bit():
    torch.manual_seed(0)
    ge = GroupedExperts(4, 32, 64, recipe=NVFP4_RECIPE)
    counts = torch.tensor([5, 0, 9, 2])
    x = _randn(16, 32, seed=8)
    y = ge(x, counts)
    assert torch.equal(y, _per_expert_reference(ge, x, counts, NVFP4_RECIPE))
    ge.recipe = None
    assert not torch.allclose(y, ge(x, counts), rtol=1e-3, atol=0)

    # the whole block: router plan -> per-expert quantized_linear -> combine
    moe = _moe(d=32, d_ff=64, recipe=NVFP4_RECIPE, shared_expert=True)
    assert isinstance(moe.shared_expert.w1, QuantizedLinear) and moe.experts.recipe is NVFP4_RECIPE
    xb = _randn(2, 9, 32, seed=9)
    x2d = xb.reshape(-1, 32)
    plan, _ = moe.router(x2d)
    ref = combine(_per_expert_reference(moe.experts, dispatch(x2d, plan), plan.counts, NVFP4_RECIPE), plan, 18)
    shared = quantized_linear(F.silu(quantized_linear(x2d, moe.shared_expert.w1.weight, None, NVFP4_RECIPE))
                              * quantized_linear(x2d, moe.shared_expert.w3.weight, None, NVFP4_RECIPE),
                              moe.shared_expert.w2.weight, None, NVFP4_RECIPE)
    ref = ref + shared.float()
    assert torch.equal(moe(xb), ref.view_as(xb))


def test_quantized_experts_backward_matches_reference_bit_for_bit():
    """Stochastic rounding draws come from torch's generator in the same order as the reference's."""
    torch.manual_seed(0)
    ge = GroupedExperts(3, 32, 32, recipe=NVFP4_RECIPE)
    counts = torch.tensor([4, 7, 5])
    x = _randn(16, 32, seed=10).requires_grad_()
    r = _randn(16, 32, seed=11)
    torch.manual_seed(1)
    (ge(x, counts) * r).sum().backward()
    got = [x.grad.clone()] + [getattr(ge, n).grad.clone() for n in ("w1", "w2", "w3")]
    ge.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(1)
    (_per_expert_reference(ge, x, counts, NVFP4_RECIPE) * r).sum().backward()
    ref = [x.grad] + [getattr(ge, n).grad for n in ("w1", "w2", "w3")]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_per_expert_outer_scales_isolate_experts():
    """Scaling one expert's weights by 1000 leaves every other expert's output unchanged, bit for bit."""
    torch.manual_seed(0)
    ge = GroupedExperts(4, 32, 48, recipe=NVFP4_RECIPE)
    counts = torch.tensor([4, 6, 3, 5])
    x = _randn(18, 32, seed=12)
    y = ge(x, counts)
    with torch.no_grad():
        for w in (ge.w1, ge.w2, ge.w3):
            w[1] *= 1000.0
    y2 = ge(x, counts)
    rows1 = torch.zeros(18, dtype=torch.bool)
    rows1[4:10] = True
    assert torch.equal(y[~rows1], y2[~rows1])
    assert not torch.allclose(y[rows1], y2[rows1])
    # contrast: one outer scale over the stacked tensor lets expert 1 crush the others' precision
    w = ge.w1.detach().clone()
    w[1] /= 1000.0
    one = dequantize(quantize(w, NVFP4(block_2d=True)))
    w[1] *= 1000.0
    big = dequantize(quantize(w, NVFP4(block_2d=True)))
    assert not torch.equal(one[0], big[0])


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("rule", ["6", "4over6"])
def test_group_outer_scale_on_stacked_weights_equals_per_expert_quantize(block_2d, rule):
    """quantize(W [E, N, K], NVFP4(outer="group")) == stack of quantize(W[e], NVFP4(outer="tensor")):
    the form a checkpoint stores, identical to what the experts' GEMMs use."""
    E = 4
    W = _randn(E, 24, 40, seed=13) * torch.tensor([1e-3, 1.0, 30.0, 1e3]).view(E, 1, 1)  # N, K not multiples of 16
    q = quantize(W, NVFP4(outer="group", block_2d=block_2d, scale_rule=rule))
    assert q.outer_scale.shape == (E, 1, 1)
    deq = dequantize(q)
    for e in range(E):
        qe = quantize(W[e], NVFP4(outer="tensor", block_2d=block_2d, scale_rule=rule))
        assert torch.equal(q.codes[e], qe.codes)
        assert torch.equal(q.scales[e].view(torch.uint8), qe.scales.view(torch.uint8))
        assert torch.equal(q.outer_scale[e].reshape(()), qe.outer_scale.reshape(()))
        assert torch.equal(q.amax[e].reshape(()), qe.amax.reshape(()))
        assert torch.equal(deq[e], dequantize(qe))


# ----------------------------------------------------------------------------- empty experts

@pytest.mark.parametrize("recipe", [None, NVFP4_RECIPE], ids=["fp32", "nvfp4"])
def test_expert_without_tokens_is_finite_with_zero_grads(recipe):
    moe = _moe(d=32, d_ff=32, recipe=recipe)
    with torch.no_grad():
        moe.router.weight[2] = -5.0  # x > 0 below: expert 2's logit is far below every other
    x = (_randn(2, 8, 32, seed=14).abs() + 0.1).requires_grad_()
    y = moe(x)
    x2d = x.detach().reshape(-1, 32)
    assert moe.router(x2d)[0].counts[2] == 0
    assert torch.isfinite(y).all()
    (y.square().sum() + moe.aux_loss).backward()
    for n in ("w1", "w2", "w3"):
        g = getattr(moe.experts, n).grad
        assert g is not None and torch.isfinite(g).all()
        assert torch.count_nonzero(g[2]) == 0 and torch.count_nonzero(g[0]) > 0, n
    assert torch.isfinite(x.grad).all() and torch.isfinite(moe.router.weight.grad).all()


@pytest.mark.parametrize("recipe", [None, NVFP4_RECIPE], ids=["fp32", "nvfp4"])
def test_grouped_experts_with_no_rows_at_all(recipe):
    ge = GroupedExperts(3, 16, 32, recipe=recipe)
    x = torch.zeros(0, 16, requires_grad=True)
    y = ge(x, torch.zeros(3, dtype=torch.long))
    assert y.shape == (0, 16)
    y.sum().backward()
    for n in ("w1", "w2", "w3"):
        g = getattr(ge, n).grad
        assert g is not None and torch.count_nonzero(g) == 0


# ----------------------------------------------------------------------------- the model

def _moe_llama_cfg(**kw):
    base = dict(vocab_size=64, moe=MoEConfig(n_experts=4, top_k=2, shared_expert=True))
    return dataclasses.replace(PRESETS["tiny"], **{**base, **kw})


def test_llama_blocks_and_loss_with_moe():
    cfg = _moe_llama_cfg(n_layers=4, moe_every=2)
    model = Llama(cfg, seed=0)
    kinds = [type(layer.feed_forward) for layer in model.layers]
    assert kinds == [FeedForward, MoE, FeedForward, MoE]
    assert model.layers[1].feed_forward.experts.d_ff == cfg.hidden_dim  # d_ff=0 -> the FFN size
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.1.feed_forward.router.weight", "layers.1.feed_forward.experts.w2",
            "layers.1.feed_forward.shared_expert.w1.weight"} <= names
    # residual-stream projections get the depth-scaled init, experts included
    std = model.layers[1].feed_forward.experts.w2.std().item()
    assert std < 0.02 / math.sqrt(2 * cfg.n_layers) * 1.2
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    ce = F.cross_entropy(logits.view(-1, 64), idx.view(-1))
    aux = model.layers[1].feed_forward.aux_loss + model.layers[3].feed_forward.aux_loss
    torch.testing.assert_close(loss, ce + aux)
    assert aux.item() > 0
    model.eval()
    torch.testing.assert_close(model(idx, idx)[1], ce)  # eval: plain cross-entropy
    copy.deepcopy(model)  # the graph-attached aux_loss does not travel


def test_presets_and_train_cli_model():
    from blockscale.cli.train import build_model

    small = PRESETS["small-moe"]
    assert dataclasses.replace(small, moe=None) == PRESETS["small"]
    assert small.moe == MoEConfig(n_experts=8, top_k=2)
    model = build_model("tiny-moe", 100, 32, seed=0)
    assert model.config.vocab_size == 100 and all(isinstance(layer.feed_forward, MoE) for layer in model.layers)


def test_convert_quantizes_experts_not_routers():
    model = Llama(_moe_llama_cfg(n_layers=2, moe_every=1), seed=0)
    router = model.layers[0].feed_forward.router
    assert any(re.search(p, "layers.0.feed_forward.router") for p in DEFAULT_EXCLUDE)
    report = convert(model, "nvfp4-nvidia")
    for i in range(2):
        ff = model.layers[i].feed_forward
        assert ff.experts.recipe == NVFP4_RECIPE
        assert report.converted[f"layers.{i}.feed_forward.experts"] == "nvfp4-nvidia"
        assert isinstance(ff.shared_expert.w2, QuantizedLinear) and ff.shared_expert.w2.recipe == NVFP4_RECIPE
        assert type(ff.router) is Router
        assert not any(isinstance(m, nn.Linear) for m in ff.router.modules())
    assert model.layers[0].feed_forward.router is router
    # the last-blocks rule reaches the experts too
    report = convert(model, get_recipe("nvfp4-nvidia").with_(last_blocks_fraction=0.5))
    assert model.layers[1].feed_forward.experts.recipe == get_recipe("bf16").linear
    assert model.layers[0].feed_forward.experts.recipe == NVFP4_RECIPE
    assert unconvert(model) > 0 and model.layers[0].feed_forward.experts.recipe is None


def _synthetic_data():
    g = torch.Generator().manual_seed(0)
    base = torch.arange(6000) % 17 * 3 % 64
    noise = torch.randint(0, 64, (6000,), generator=g)
    keep = torch.rand(6000, generator=g) < 0.8
    return TokenData.from_tokens(torch.where(keep, base, noise), vocab_size=64)


def _train_cfg(steps):
    return TrainConfig(steps=steps, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=0,
                       eval_batches=1, log_interval=1, progress=False, device="cpu", autocast="none", seed=7)


def test_moe_llama_trains_with_the_trainer():
    model = Llama(_moe_llama_cfg(), seed=0)
    result = train(model, _synthetic_data(), _train_cfg(25))
    losses = result.train_losses
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    # the last step reached every expert and the router
    for layer in model.layers:
        ff = layer.feed_forward
        assert torch.count_nonzero(ff.router.weight.grad) > 0
        assert (ff.experts.w1.grad.abs().sum(dim=(1, 2)) > 0).all()


def test_moe_llama_trains_with_nvfp4_recipe():
    model = Llama(_moe_llama_cfg(), seed=0)
    convert(model, "nvfp4-nvidia")
    result = train(model, _synthetic_data(), _train_cfg(8))
    assert all(math.isfinite(v) for v in result.train_losses)
    losses = result.train_losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
