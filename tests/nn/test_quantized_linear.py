"""QuantizedLinear: each GEMM follows its recipe exactly, gradients stay within format bounds,
SR backward is unbiased, and saved activations are small."""
import math

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
from blockscale.nn import QuantizedLinear
from blockscale.quant.transforms.hadamard import rht_matrix
from blockscale.recipes import LinearRecipe, get_recipe

pytestmark = pytest.mark.usefixtures("reference_backend")

RECIPES = ["bf16", "mxfp8", "nvfp4-nvidia", "nvfp4-nvidia-4over6", "nvfp4-fwd-mxfp8-bwd"]


def _setup(seed=0, m=48, k=64, n=32, bias=True):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(2, m // 2, k, generator=g)
    dy = torch.randn(2, m // 2, n, generator=g)
    return lin, x, dy


def _op(t, spec, r: LinearRecipe, g):
    """The recipe's operand, independently: fake-quantized along the last dim, or cast."""
    if spec is None:
        return t.to(torch.bfloat16 if r.unquantized_dtype == "bfloat16" else torch.float32).float()
    return bs.fake_quantize(t, spec, g, dtype=torch.float32)


def _manual(lin, x, dy, r: LinearRecipe, seed):
    """y, dx, dW, db per the recipe's definition (module docstring of blockscale.recipes.recipe)."""
    g = torch.Generator().manual_seed(seed)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    xq = _op(x2, r.fprop_input, r, g)
    wq = _op(lin.weight.detach(), r.fprop_weight, r, g)
    y = xq @ wq.t() + lin.bias.detach()
    a = _op(dy2, r.dgrad_grad, r, g)
    b = wq if r.reuse_fprop_weight else _op(wq.t().contiguous(), r.dgrad_weight, r, g).t()
    dx = a @ b
    at, bt = dy2.t().float(), xq.t()
    if r.wgrad_hadamard:
        signs = bs.TE_SIGNS_16 if r.hadamard_signs == "te" else bs.random_signs(r.wgrad_hadamard, generator=g)
        pad = (-at.shape[-1]) % r.wgrad_hadamard
        # the layer applies the RHT as one GEMM with the n x n matrix diag(s) H / sqrt(n)
        m = rht_matrix(r.wgrad_hadamard, signs)
        at = (F.pad(at, (0, pad)).reshape(-1, r.wgrad_hadamard) @ m).reshape(at.shape[0], -1)
        bt = (F.pad(bt, (0, pad)).reshape(-1, r.wgrad_hadamard) @ m).reshape(bt.shape[0], -1)
    dw = _op(at.contiguous(), r.wgrad_grad, r, g) @ _op(bt.contiguous(), r.wgrad_input, r, g).t()
    return y.view(*x.shape[:-1], -1), dx.view_as(x), dw, dy2.sum(0), (xq, wq, at.contiguous(), bt.contiguous())


def _layer_grads(lin, x, dy, r, seed):
    q = QuantizedLinear.from_linear(lin, r, generator=torch.Generator().manual_seed(seed))
    xr = x.clone().requires_grad_(True)
    lin.weight.grad = lin.bias.grad = None
    y = q(xr)
    y.backward(dy)
    return y.detach(), xr.grad, lin.weight.grad.clone(), lin.bias.grad.clone()


@pytest.mark.parametrize("name", RECIPES)
def test_every_gemm_follows_the_recipe_exactly(name):
    r = get_recipe(name).linear
    lin, x, dy = _setup(m=40)  # 40 tokens: wgrad's Hadamard pads to 48
    y, dx, dw, db = _layer_grads(lin, x, dy, r, seed=3)
    my, mdx, mdw, mdb, _ = _manual(lin, x, dy, r, seed=3)
    assert torch.equal(y, my)
    assert torch.equal(dx, mdx)
    assert torch.equal(dw, mdw)
    assert torch.allclose(db, mdb, rtol=1e-6, atol=1e-6)


def test_bf16_recipe_is_bf16_operands_fp32_accumulation():
    lin, x, dy = _setup()
    y, dx, dw, db = _layer_grads(lin, x, dy, get_recipe("bf16").linear, seed=0)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    x2, dy2, w = x.reshape(-1, 64), dy.reshape(-1, 32), lin.weight.detach()
    assert torch.equal(y.reshape(-1, 32), bf(x2) @ bf(w).t() + lin.bias.detach())
    assert torch.equal(dx.reshape(-1, 64), bf(dy2) @ bf(w))
    assert torch.equal(dw, bf(dy2.t()) @ bf(x2.t()).t())


def _block_amax(t, spec):
    """Each element's block amax (1x16, padded), or the tensor amax for 16x16 tiles (an upper bound)."""
    if spec.block_2d:
        return t.abs().amax().expand_as(t)
    k = t.shape[-1]
    a = F.pad(t.abs(), (0, (-k) % 16)).reshape(*t.shape[:-1], -1, 16).amax(-1)
    return a.repeat_interleave(16, -1)[..., :k]


def _delta(t, spec):
    """Elementwise worst-case |t^ - t| of quantizing ``t`` (along its last dim) to ``spec``."""
    if spec is None:
        return t.abs() * 2.0**-8  # bf16 RNE: half an ulp, relative 2^-8
    q = bs.quantize(t, spec)
    steps = 2.0 if spec.rounding == "stochastic" else 1.0  # SR: a whole spacing, RNE: half of one
    if isinstance(spec, bs.NVFP4):
        unit = (q.scales.float() * (1.0 / q.outer_scale)).repeat_interleave(16, -1)[..., : t.shape[-1]]
        # rounding: top-binade spacing of E2M1 is 2 units; saturation (scale rounded down): amax - 6 units
        return torch.maximum(steps * unit, _block_amax(t, spec) - 6 * unit)
    k = (q.scales.float() - 127).repeat_interleave(32, -1)[..., : t.shape[-1]]
    half_ulp_top = {"e4m3": 16.0, "e5m2": 4096.0, "e2m1": 1.0}[spec.element]  # "ceil": nothing saturates
    return steps * half_ulp_top * torch.pow(2.0, k)


def _bound(a, b, spec_a, spec_b):
    """|A^ B^T - A B^T| <= dA |B|^T + (|A| + dA) dB^T, plus FP32 accumulation (K * 2^-23 relative)."""
    da, db = _delta(a, spec_a).double(), _delta(b, spec_b).double()
    a, b = a.abs().double(), b.abs().double()
    fp32 = a.shape[-1] * 2.0**-23 * ((a + da) @ (b + db).t())
    return da @ b.t() + (a + da) @ db.t() + fp32


@pytest.mark.parametrize("name", RECIPES)
def test_gradients_within_format_bounds_of_full_precision(name):
    r = get_recipe(name).linear
    lin, x, dy = _setup(seed=1, m=64)
    _, dx, dw, _ = _layer_grads(lin, x, dy, r, seed=0)
    _, _, _, _, (xq, wq, at, bt) = _manual(lin, x, dy, r, seed=0)
    x2, dy2, w = x.reshape(-1, 64), dy.reshape(-1, 32), lin.weight.detach()
    # dgrad vs dy @ W. Reused 16x16 weight: quantizing W^T is the forward's W^, transposed.
    if r.reuse_fprop_weight:
        b_dx = _bound(dy2, w.t().contiguous(), r.dgrad_grad, r.fprop_weight)
    else:  # two stages: W -> W^ (forward), W^^T re-quantized for dgrad
        b_dx = _bound(dy2, wq.t().contiguous(), r.dgrad_grad, r.dgrad_weight)
        b_dx += (dy2.abs() + _delta(dy2, r.dgrad_grad)).double() @ (wq - w).abs().double()
    err = (dx.reshape(-1, 64).double() - dy2.double() @ w.double()).abs()
    assert (err <= b_dx).all(), f"dgrad error {err.max():.3e} exceeds its bound"
    # wgrad vs dy^T @ x: the bound of the rotated operands' GEMM, plus the forward's x -> x^ error
    # (the rotation itself is orthogonal; its FP32 rounding gets a 1e-5 relative allowance)
    b_dw = _bound(at, bt, r.wgrad_grad, r.wgrad_input)
    b_dw += dy2.t().abs().double() @ (xq - x2).abs().double()
    b_dw += 1e-5 * (at.abs().double() @ bt.abs().double().t())
    err = (dw.double() - dy2.t().double() @ x2.double()).abs()
    assert (err <= b_dw).all(), f"wgrad error {err.max():.3e} exceeds its bound"
    # and the bounds are tight enough to mean something: within ~100x of the observed worst case
    assert b_dx.max() < 100 * err.new_tensor(float((dx.reshape(-1, 64).double() - dy2.double() @ w.double()).abs().max()))


def test_stochastic_rounding_backward_is_unbiased():
    """Mean dW over seeds -> full-precision dW with SR; round-to-nearest keeps its bias."""
    lin, x, dy = _setup(seed=2, m=32, k=32, n=16)
    dy = dy * 1e-3
    exact = dy.reshape(-1, 16).t().double() @ x.reshape(-1, 32).double()
    sr = LinearRecipe(wgrad_grad=bs.MX(element="e2m1", rounding="stochastic", sr_mode="exact"),
                      wgrad_input=bs.MX(element="e2m1", rounding="stochastic", sr_mode="exact"),
                      unquantized_dtype="float32")
    rtn = LinearRecipe(wgrad_grad=bs.MX(element="e2m1"), wgrad_input=bs.MX(element="e2m1"),
                       unquantized_dtype="float32")
    n = 256
    mean = sum(_layer_grads(lin, x, dy, sr, seed=s)[2].double() for s in range(n)) / n
    rtn_dw = _layer_grads(lin, x, dy, rtn, seed=0)[2].double()
    err_sr = (mean - exact).norm() / exact.norm()
    err_rtn = (rtn_dw - exact).norm() / exact.norm()
    single = (_layer_grads(lin, x, dy, sr, seed=999)[2].double() - exact).norm() / exact.norm()
    assert err_sr < 0.25 * err_rtn
    assert err_sr < 2.5 * single / math.sqrt(n)  # variance shrinks as 1/n: no bias left


def _saved_bytes(layer, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum()
    return total


@pytest.mark.parametrize("name", ["nvfp4-nvidia", "nvfp4-nvidia-4over6", "nvfp4-fwd-mxfp8-bwd"])
def test_saved_tensor_memory(name):
    lin = torch.nn.Linear(512, 256, bias=False)
    x = torch.randn(256, 512, requires_grad=True)
    bf16 = QuantizedLinear.from_linear(lin, get_recipe("bf16").linear)
    q = QuantizedLinear.from_linear(lin, get_recipe(name).linear)
    ratio = _saved_bytes(q, x) / _saved_bytes(bf16, x)
    assert ratio <= 0.35, ratio
    assert _saved_bytes(bf16, x) == 2 * (256 * 512 + 256 * 512)  # x and W in bf16


def test_dtypes_master_weights_and_bias_free():
    lin, x, dy = _setup(bias=False)
    q = QuantizedLinear.from_linear(lin, get_recipe("nvfp4-fwd-mxfp8-bwd").linear)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    y = q(xb)
    assert y.dtype == torch.bfloat16 and q.weight.dtype == torch.float32
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and q.weight.grad.dtype == torch.float32
    assert "NVFP4" in repr(q)


def test_a_registered_gemm_backend_receives_packed_operands():
    """A real low-precision kernel slots in per backend and gets codes + scales for every operand."""
    from blockscale.nn import gemm as gemm_mod

    seen = []

    def packed_gemm(a, b):
        for op in (a, b):
            seen.append(None if op.q is None else (type(op.q.spec).__name__, op.q.codes.dtype))
        return gemm_mod.emulated_gemm(a, b)

    gemm_mod.register_gemm_backend("recording", packed_gemm, needs_codes=True)
    lin, x, dy = _setup(m=32)
    r = get_recipe("nvfp4-fwd-mxfp8-bwd").linear
    ref = _layer_grads(lin, x, dy, r, seed=1)
    gemm_mod.set_gemm_backend("recording")
    try:
        got = _layer_grads(lin, x, dy, r, seed=1)
    finally:
        gemm_mod.set_gemm_backend("emulated")
    assert seen == [("NVFP4", torch.uint8)] * 2 + [("MX", torch.float8_e4m3fn)] * 4
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not registered"):
        gemm_mod.set_gemm_backend("cutlass")
