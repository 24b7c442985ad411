"""LSQ (learned step size) NVFP4 block-scale learner: exactness, STE gradients, no flush to zero."""
import pytest
import torch

import blockscale as bs
from blockscale.lsq import NVFP4ScaleLearner, lsq_fake_quantize
from blockscale.quant.nvfp4 import e4m3_positive_values, outer_scale

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _w(n=8, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _S(w, rule="6"):
    return outer_scale(w.abs().max(), bs.NVFP4(scale_rule=rule).outer_bound)


# ---------------------------------------------------------------- 1. step-0 equality
@pytest.mark.parametrize("mode", ["tied", "dual"])
@pytest.mark.parametrize("rule", ["6", "4over6", "sweep", "4"])
def test_init_matches_library_fake_quantize(mode, rule):
    w = _w()
    S = _S(w, rule)
    L = NVFP4ScaleLearner(w, S, mode=mode, init=rule)
    ref = bs.fake_quantize(w, bs.NVFP4(scale_rule=rule), encode_scale=S)
    out = L()
    assert out.dtype == torch.float32 and out.shape == w.shape
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    if mode == "dual":
        assert torch.equal(L.amax_pre, L.amax_post)
    q_ref = bs.quantize(w, bs.NVFP4(scale_rule=rule), encode_scale=S)
    q = L.to_quantized()
    assert torch.equal(q.codes, q_ref.codes)
    assert torch.equal(q.scales.view(torch.uint8), q_ref.scales.view(torch.uint8))


def test_init_mse_aliases_sweep_and_4over6_differs_from_6():
    w = _w(seed=3)
    S = _S(w, "sweep")
    a = NVFP4ScaleLearner(w, S, init="mse")
    b = NVFP4ScaleLearner(w, S, init="sweep")
    assert torch.equal(a(), b())
    S46 = _S(w, "4over6")
    a46 = NVFP4ScaleLearner(w, S46, init="4over6")
    a6 = NVFP4ScaleLearner(w, S46, init="6")
    assert not torch.equal(a46.amax, a6.amax)  # some blocks pick scale-to-4


# ---------------------------------------------------------------- 2. export exactness
@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_export_exact_after_perturbation(mode):
    w = _w(16, 128, seed=1)
    S = _S(w)
    L = NVFP4ScaleLearner(w, S, mode=mode)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ([L.amax] if mode == "tied" else [L.amax_pre, L.amax_post]):
            p.mul_(torch.exp(0.5 * torch.randn(p.shape, generator=g)))
    if mode == "dual":
        assert not torch.equal(L.amax_pre, L.amax_post)
    out = L()
    q = L.to_quantized()
    deq = q.dequantize()
    assert torch.equal(deq.view(torch.int32), out.view(torch.int32))
    assert torch.equal(bs.dequantize(q), out)
    # codes: every nibble is a valid E2M1 code; values bounded by 6
    from blockscale.formats.e2m1 import e2m1_lut, unpack_nibbles
    codes = unpack_nibbles(q.codes)
    assert int(codes.max()) <= 15
    assert float(e2m1_lut(codes.device)[codes.long()].abs().max()) <= 6.0
    # scales: finite, non-negative E4M3 values, round-tripping exactly
    sf = q.scales.to(torch.float32)
    assert bool(torch.isfinite(sf).all()) and float(sf.min()) >= 0 and float(sf.max()) <= 448
    grid = torch.cat([torch.zeros(1), e4m3_positive_values()])
    assert bool(torch.isin(sf, grid).all())
    assert torch.equal(q.outer_scale, S.reshape(()))


# ---------------------------------------------------------------- 3. analytic gradients
def _one_block(vals, amax_value=6.0):
    """1 x 16 weight with S = 1 and amax = 6 -> s_e = 1, s = 1 (x/s = x)."""
    w = torch.zeros(1, 16)
    w[0, : len(vals)] = torch.tensor(vals)
    return w, torch.tensor(1.0), torch.full((1, 1), amax_value)


def test_tied_gradients_hand_values():
    w, S, a = _one_block([2.3, 7.5, -9.0, -0.7, 6.0])
    w.requires_grad_(True)
    a.requires_grad_(True)
    out = lsq_fake_quantize(w, a, S)
    assert out[0, :5].tolist() == [2.0, 6.0, -6.0, -0.5, 6.0]
    for j, gexp, dxexp in [(0, 2.0 - 2.3, 1.0), (1, 6.0, 0.0), (2, -6.0, 0.0), (3, -0.5 + 0.7, 1.0),
                           (4, 0.0, 1.0)]:
        w.grad = a.grad = None
        out = lsq_fake_quantize(w, a, S)
        out[0, j].backward()
        assert a.grad.item() == pytest.approx(gexp / 6.0, abs=1e-6)  # dL/damax = g / 6
        assert w.grad[0, j].item() == dxexp
        assert float(w.grad.abs().sum()) == dxexp
    # a weighted sum: dL/ds = sum dL/dx~ * g
    w.grad = a.grad = None
    gout = torch.zeros(1, 16)
    gout[0, :5] = torch.tensor([1.0, 2.0, -3.0, 0.5, 4.0])
    (lsq_fake_quantize(w, a, S, grad_scale=0.25) * gout).sum().backward()
    ds = 1.0 * -0.3 + 2.0 * 6 + -3.0 * -6 + 0.5 * 0.2 + 4.0 * 0.0
    assert a.grad.item() == pytest.approx(ds / 6 * 0.25, rel=1e-5)
    assert w.grad[0, :5].tolist() == [1.0, 0.0, 0.0, 0.5, 4.0]


def test_dual_gradients_hand_values():
    # s_pre = 1 (amax_pre 6), s_post = 1.25 (amax_post 7.5: 7.5/6 = 1.25 exactly on the E4M3 grid)
    w, S, a_pre = _one_block([2.3, 7.5, -9.0, -0.7])
    a_post = torch.full((1, 1), 7.5, requires_grad=True)
    a_pre.requires_grad_(True)
    w.requires_grad_(True)
    gout = torch.zeros(1, 16)
    gout[0, :4] = torch.tensor([1.0, 2.0, -3.0, 0.5])
    out = lsq_fake_quantize(w, a_pre, S, amax_post=a_post)
    assert out[0, :4].tolist() == [2.5, 7.5, -7.5, -0.625]
    (out * gout).sum().backward()
    q = torch.tensor([2.0, 6.0, -6.0, -0.5])
    x = torch.tensor([2.3, 7.5, -9.0, -0.7])
    ins = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ds_post = float((gout[0, :4] * q).sum())
    ds_pre = float((gout[0, :4] * ins * (-1.25 * x / 1.0 ** 2)).sum())
    assert a_post.grad.item() == pytest.approx(ds_post / 6, rel=1e-6)
    assert a_pre.grad.item() == pytest.approx(ds_pre / 6, rel=1e-6)
    assert w.grad[0, :4].tolist() == pytest.approx((gout[0, :4] * ins * 1.25).tolist())
    # grad_scale multiplies both amax gradients
    a_pre.grad = a_post.grad = None
    (lsq_fake_quantize(w, a_pre, S, amax_post=a_post, grad_scale=3.0) * gout).sum().backward()
    assert a_post.grad.item() == pytest.approx(3 * ds_post / 6, rel=1e-6)
    assert a_pre.grad.item() == pytest.approx(3 * ds_pre / 6, rel=1e-6)


def _xs():
    # values on both sides of the clamp, none exactly on a rounding tie or at |x/s| = 6
    return torch.tensor([0.3, -1.1, 2.3, 3.6, -4.4, 5.2, 7.5, -9.0, 0.05, -2.7, 1.3, -5.9, 8.8, 0.9, -0.2, 2.6])


def test_dual_ds_post_matches_finite_difference_exactly_linear():
    x = _xs().reshape(1, 16)
    gout = torch.linspace(-1, 2, 16).reshape(1, 16)
    S = torch.tensor(1.0)
    a_pre = torch.full((1, 1), 6.0)
    # s_post on two E4M3 grid points 1.0 and 1.125 (amax 6 and 6.75): x~ is exactly linear in s_post
    L = lambda ap: float((lsq_fake_quantize(x, a_pre, S, amax_post=torch.full((1, 1), ap)) * gout).double().sum())
    fd = (L(6.75) - L(6.0)) / 0.125
    a_post = torch.full((1, 1), 6.0, requires_grad=True)
    (lsq_fake_quantize(x, a_pre, S, amax_post=a_post) * gout).sum().backward()
    assert a_post.grad.item() * 6 == pytest.approx(fd, rel=1e-5)


def _surrogate_grad(x, gout, s0, fn):
    h = 1e-6
    return (fn(s0 + h) - fn(s0 - h)) / (2 * h)


def test_tied_and_dual_ds_pre_match_straight_through_surrogate_fd():
    x32 = _xs().reshape(1, 16)
    x = x32.double()[0]
    gout = torch.linspace(-1, 2, 16).double()
    grid = E2M1_GRID.double()
    s0 = 1.0
    u0 = x / s0
    r0 = torch.sign(u0) * grid[(u0.abs().unsqueeze(-1) - grid).abs().argmin(-1)]
    c = torch.where(u0.abs() <= 6, r0 - u0, torch.zeros_like(u0))  # round(.) frozen (outside: stays clamped)

    inside0 = u0.abs() <= 6

    def sur(s):  # the STE surrogate: inside (frozen) x/s + c, outside clamp(x/s)
        return torch.where(inside0, x / s + c, torch.clamp(x / s, -6, 6))

    def tied(s):
        return float((gout * s * sur(s)).sum())

    s_post = 1.25

    def dual_pre(s):
        return float((gout * s_post * sur(s)).sum())

    S = torch.tensor(1.0)
    a = torch.full((1, 1), 6.0, requires_grad=True)
    (lsq_fake_quantize(x32, a, S) * gout.float()).sum().backward()
    assert a.grad.item() * 6 == pytest.approx(_surrogate_grad(x, gout, s0, tied), rel=1e-5)

    a_pre = torch.full((1, 1), 6.0, requires_grad=True)
    a_post = torch.full((1, 1), 7.5)
    (lsq_fake_quantize(x32, a_pre, S, amax_post=a_post) * gout.float()).sum().backward()
    assert a_pre.grad.item() * 6 == pytest.approx(_surrogate_grad(x, gout, s0, dual_pre), rel=1e-5)


def test_module_grad_scale_and_train_weight():
    w = _w()
    S = _S(w)
    L1 = NVFP4ScaleLearner(w, S, grad_scale=1.0)
    L2 = NVFP4ScaleLearner(w, S, grad_scale=0.125, train_weight=True)
    assert not L1.weight.requires_grad and L2.weight.requires_grad
    gout = torch.randn(w.shape, generator=torch.Generator().manual_seed(2))
    (L1() * gout).sum().backward()
    (L2() * gout).sum().backward()
    assert torch.equal(L2.amax.grad, L1.amax.grad * 0.125)
    assert L1.weight.grad is None and L2.weight.grad is not None
    assert bool(torch.isfinite(L2.weight.grad).all())


# ---------------------------------------------------------------- 4. tiny blocks / zero blocks
def test_tiny_block_is_not_flushed():
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-100, 100, 16)          # tensor amax 1e2
    w[1, :16] = torch.linspace(1e-4, 5e-4, 16)         # a block ~1e-4 (E4M3 subnormal block scale)
    w[1, 16:] = torch.linspace(-1e-4, 1e-4, 16)        # amax 1e-4: below E4M3's range, the library flushes it too
    w[0, 16:] = torch.linspace(-3e-3, 3e-3, 16)
    S = _S(w)
    for mode in ("tied", "dual"):
        L = NVFP4ScaleLearner(w, S, mode=mode)
        out = L()
        ref = bs.fake_quantize(w, bs.NVFP4(), encode_scale=S)
        assert torch.equal(out, ref)
        assert bool((out[1, :16] != 0).all())           # every value of the small block survives
        assert float((out[1, :16] - w[1, :16]).detach().abs().max()) < 1e-4
        assert torch.equal(L.to_quantized().dequantize(), out)
    # a ModelOpt-style floor (amax >= global_amax / 512) would have flushed that block
    floored = torch.clamp(NVFP4ScaleLearner(w, S).amax, min=100.0 / 512)
    assert bool((lsq_fake_quantize(w, floored, S)[1, :16] == 0).all())


@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_zero_amax_block_gives_zeros_and_finite_gradients(mode):
    w = _w(2, 32, seed=4)
    S = _S(w)
    L = NVFP4ScaleLearner(w, S, mode=mode, train_weight=True)
    params = [L.amax] if mode == "tied" else [L.amax_pre, L.amax_post]
    with torch.no_grad():
        for p in params:
            p[0, 1] = 0.0
            p[1, 0] = -0.5  # negative amax: scale 0 as well
    out = L()
    assert bool((out[0, 16:] == 0).all()) and bool((out[1, :16] == 0).all())
    assert bool((out[0, :16] != 0).any())
    ((out - w) ** 2).sum().backward()
    for p in params:
        assert bool(torch.isfinite(p.grad).all())
        assert p.grad[0, 1].item() == 0 and p.grad[1, 0].item() == 0
    assert bool(torch.isfinite(L.weight.grad).all())
    assert bool((L.weight.grad[0, 16:] == 0).all())
    assert torch.equal(L.to_quantized().dequantize(), out.detach())


# ---------------------------------------------------------------- 5. scale-only training
@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_scale_only_training_reduces_loss(mode):
    """SGD on sum((x~ - W)^2) from amax scaled by 1.7 (dual: amax_post; the dual STE gradient of
    amax_pre ignores how the rounding error depends on s_pre and is not a descent direction by itself)."""
    w = _w(16, 64, seed=5)
    S = _S(w)
    L = NVFP4ScaleLearner(w, S, mode=mode)
    w0 = L.weight.detach().clone()
    params = [p for p in L.parameters() if p.requires_grad]
    assert len(params) == (1 if mode == "tied" else 2)
    with torch.no_grad():
        (L.amax if mode == "tied" else L.amax_post).mul_(1.7)
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.3 if mode == "tied" else 0.03)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = ((L() - w0) ** 2).sum()
        losses.append(float(loss.detach()))
        loss.backward()
        assert L.weight.grad is None
        opt.step()
    with torch.no_grad():
        final = float(((L() - w0) ** 2).sum())
    assert final < (0.85 if mode == "tied" else 0.1) * losses[0]
    assert torch.equal(L.weight.detach().view(torch.int32), w0.view(torch.int32))
    assert not L.weight.requires_grad
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert torch.equal(L.to_quantized().dequantize(), L().detach())


# ---------------------------------------------------------------- input checks
def test_bad_arguments_raise():
    w = _w()
    S = _S(w)
    with pytest.raises(ValueError, match="mode"):
        NVFP4ScaleLearner(w, S, mode="both")
    with pytest.raises(ValueError, match="init"):
        NVFP4ScaleLearner(w, S, init="8")
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4ScaleLearner(torch.randn(4, 20), S)
    with pytest.raises(ValueError, match="2-D"):
        NVFP4ScaleLearner(torch.randn(64), S)
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        NVFP4ScaleLearner(bad, S)
    with pytest.raises(ValueError, match="encode_scale"):
        NVFP4ScaleLearner(w, torch.tensor(0.0))
    with pytest.raises(ValueError, match="encode_scale"):
        NVFP4ScaleLearner(w, torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------- the compiled fast path
def _lsq_run(backend, w, amax, post, S, train_weight):
    w = w.clone().requires_grad_(train_weight)
    amax = amax.clone().requires_grad_(True)
    post = None if post is None else post.clone().requires_grad_(True)
    with bs.use_backend(backend):
        y = lsq_fake_quantize(w, amax, S, post, grad_scale=0.7)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return [y, w.grad, amax.grad, None if post is None else post.grad]


@pytest.mark.parametrize("mode,train_weight", [("tied", True), ("dual", False)])
def test_compiled_lsq_equals_reference(mode, train_weight):
    # forward and every gradient bit for bit; hard cases: a zero block, a block whose amax rounds its scale to 0,
    # E4M3-subnormal scales, saturated values (amax below the block's max), magnitudes over 9 decades
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-6, 3, 128)
    w[0, :16] = 0.0
    amax = w.abs().reshape(48, 8, 16).amax(-1) * (1 + 0.3 * torch.randn(48, 8, generator=g))
    amax[1, 1] = 1e-30
    amax[2] = amax[2] * 0.5
    S = _S(w)
    post = None if mode == "tied" else amax * (1 + 0.1 * torch.randn(48, 8, generator=g))
    ref = _lsq_run("reference", w, amax, post, S, train_weight)
    fast = _lsq_run("compiled", w, amax, post, S, train_weight)
    for r, f in zip(ref, fast):
        assert (r is None) == (f is None)
        if r is not None:
            assert torch.equal(r.view(torch.int32), f.view(torch.int32))
    assert (ref[1] is not None) == train_weight
