"""NVFP4-aware GPTQ (blockscale.ptq.methods.gptq): RTN equivalence with a diagonal Hessian, output error
below RTN on correlated inputs, the exact GPTQ loss identity, format validity, input checks."""
import pytest
import torch

from blockscale.formats.e2m1 import E2M1_VALUES, unpack_nibbles
from blockscale.ptq.methods.gptq import GPTQOptions, gptq_quantize
from blockscale.ptq.methods.gptq.algorithm import _gptq
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant import MX, NVFP4, quantize
from blockscale.quant.nvfp4 import outer_scale

pytestmark = pytest.mark.usefixtures("one_thread")

N, K, T = 48, 128, 384  # rows, in_features, calibration tokens


def _weight(seed, n=N, k=K, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, torch.randperm(k, generator=g)[:4]] *= 4.0  # a few large input channels
    return w.to(dtype)


def _inputs(seed, k=K, t=T):
    """Correlated activations: Z @ A (random mixing), plus a few outlier channels."""
    g = torch.Generator().manual_seed(1000 + seed)
    z = torch.randn(t, k, generator=g)
    a = torch.randn(k, k, generator=g) / k ** 0.5 + 0.5 * torch.eye(k)
    x = z @ a
    x[:, torch.randperm(k, generator=g)[:3]] *= 8.0
    return x


def _hessian(x):
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.H


def _S(w, spec):
    return outer_scale(w.float().abs().amax(), spec.outer_bound)


def _out_err(w, q, x):
    return float(((w.float() - q) @ x.T).double().square().sum())


def _assert_same_qtensor(a, b):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.outer_scale, b.outer_scale) and torch.equal(a.amax, b.amax)
    assert a.shape == b.shape and a.dtype == b.dtype and a.spec == b.spec


# ---------------------------------------------------------------------------------------------
# 1. diagonal Hessian: no error propagation, so GPTQ == RTN bit for bit


@pytest.mark.parametrize("spec", [NVFP4("6"), NVFP4("4"), NVFP4("sweep"), NVFP4("6", block_2d=True),
                                  NVFP4("sweep", block_2d=True), NVFP4("4over6", error="mae")], ids=str)
@pytest.mark.parametrize("cfg", [GPTQOptions(four_over_six="plain"), GPTQOptions(static_groups=True),
                                 GPTQOptions(act_order=True, block_size=32)], ids=["dynamic", "static", "act_order"])
def test_diagonal_hessian_equals_rtn(spec, cfg):
    w = _weight(1, n=40)  # 40 rows: the 2D case has a partial tile
    g = torch.Generator().manual_seed(7)
    H = torch.diag(torch.rand(K, generator=g) * 3 + 0.1)  # uncorrelated inputs, unequal variances
    S = _S(w, spec)
    q, _ = gptq_quantize(w, H, spec, S, cfg)
    _assert_same_qtensor(q, quantize(w, spec, encode_scale=S))


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diagonal_hessian_aware_4over6_equals_rtn_mse(block_2d, dtype):
    """With H = 4*I and no dampening every d_j = 1/2, so the aware GPTQ loss is exactly 4x the
    block's squared error, summed in the same order: the aware choice is RTN 4/6 with error="mse"."""
    w = _weight(2, n=40, dtype=dtype)
    spec = NVFP4("4over6", error="mse", block_2d=block_2d)
    S = _S(w, spec)
    q, st = gptq_quantize(w, 4.0 * torch.eye(K), spec, S, GPTQOptions(damp=0.0))
    ref = quantize(w, spec, encode_scale=S)
    _assert_same_qtensor(q, ref)
    assert q.dtype == dtype
    s6, s4 = (quantize(w, NVFP4(r, block_2d=block_2d), encode_scale=S).scales.float() for r in ("6", "4"))
    chose4 = (q.scales.float() == s4) & (s4 != s6)
    assert st["frac_scale4"] == pytest.approx(float(chose4.double().mean()), abs=1e-12)
    assert st["frac_scale4"] > (0.3 if not block_2d else 0.03)


# ---------------------------------------------------------------------------------------------
# 2. correlated inputs: GPTQ beats RTN on the layer output error


SEEDS = (0, 1, 2)


@pytest.mark.parametrize("rule,cfg", [
    ("6", GPTQOptions()), ("4over6", GPTQOptions()), ("4over6", GPTQOptions(four_over_six="plain")),
    ("sweep", GPTQOptions()), ("6", GPTQOptions(static_groups=True)), ("6", GPTQOptions(act_order=True)),
    ("4over6", GPTQOptions(act_order=True, block_size=32)),
], ids=["6", "4over6-aware", "4over6-plain", "sweep", "6-static", "6-act_order", "4over6-act_order"])
def test_gptq_beats_rtn_on_output_error(rule, cfg):
    spec = NVFP4(rule)
    for seed in SEEDS:
        w, x = _weight(seed), _inputs(seed)
        S = _S(w, spec)
        q, _ = gptq_quantize(w, _hessian(x), spec, S, cfg)
        e_gptq = _out_err(w, q.dequantize(), x)
        e_rtn = _out_err(w, quantize(w, spec, encode_scale=S).dequantize(), x)
        # measured GPTQ/RTN on seeds 0-2: 6 0.41-0.42, 4over6 aware 0.32-0.39, plain 0.38-0.45,
        # sweep 0.41-0.52, 6 static 0.46-0.48, 6 act_order 0.25-0.29, 4over6 act_order 0.27-0.29
        assert e_gptq < 0.75 * e_rtn, (seed, e_gptq / e_rtn)


def test_aware_4over6_beats_plain_on_average():
    spec = NVFP4("4over6")
    ratios = []
    for seed in range(4):
        w, x = _weight(seed), _inputs(seed)
        H, S = _hessian(x), _S(w, spec)
        qa, sa = gptq_quantize(w, H, spec, S, GPTQOptions(four_over_six="aware"))
        qp, sp = gptq_quantize(w, H, spec, S, GPTQOptions(four_over_six="plain"))
        ratios.append(_out_err(w, qa.dequantize(), x) / _out_err(w, qp.dequantize(), x))
        assert sa["loss"] < sp["loss"]  # measured aware/plain GPTQ loss: 0.80-0.91
        assert 0.2 < sa["frac_scale4"] < 0.8 and 0.2 < sp["frac_scale4"] < 0.8
    # measured aware/plain output-error ratios on seeds 0-3: 0.796, 0.908, 0.870, 0.795 (mean 0.84)
    assert sum(ratios) / len(ratios) < 0.95, ratios


def test_gptq_loss_identity():
    """W - Q = E U with U the upper Cholesky factor of Hd^-1 (Hd = H + dampening), so the GPTQ loss
    sum E^2 equals tr((W - Q) Hd (W - Q)^T): checks every lazy update, block sizes and act_order."""
    w, x = _weight(3), _inputs(3)
    H = _hessian(x)
    H[5, :] = 0  # a dead input channel
    H[:, 5] = 0
    spec = NVFP4("4over6")
    S = _S(w, spec)
    for cfg in (GPTQOptions(block_size=16), GPTQOptions(block_size=48), GPTQOptions(act_order=True, damp=0.1)):
        Q, _, _, _, st = _gptq(w, H, spec, S, cfg)
        Hd = H.double().clone()
        Hd[5, 5] = 1.0
        Hd += cfg.damp * float(torch.diagonal(Hd).mean()) * torch.eye(K, dtype=torch.float64)
        w0 = w.double().clone()
        w0[:, 5] = 0.0
        d = w0 - Q.double()
        assert st["dead_columns"] == 1
        assert torch.all(Q[:, 5] == 0)
        assert abs(float(torch.trace(d @ Hd @ d.T)) / st["loss"] - 1) < 1e-4


def test_block_size_only_reorders_updates():
    w, x = _weight(4), _inputs(4)
    H, spec = _hessian(x), NVFP4("6")
    S = _S(w, spec)
    q16, s16 = gptq_quantize(w, H, spec, S, GPTQOptions(block_size=16))
    q128, s128 = gptq_quantize(w, H, spec, S, GPTQOptions(block_size=128))
    assert abs(s16["loss"] / s128["loss"] - 1) < 0.02
    same = (unpack_nibbles(q16.codes) == unpack_nibbles(q128.codes)).float().mean()
    assert same > 0.9  # FP32 order differences flip a few near-tie roundings


# ---------------------------------------------------------------------------------------------
# 3. the returned QuantizedTensor is the GPTQ result, in a valid NVFP4 encoding


@pytest.mark.parametrize("rule,cfg", [("6", GPTQOptions()), ("4over6", GPTQOptions()), ("sweep", GPTQOptions()),
                                      ("4over6", GPTQOptions(act_order=True)), ("4", GPTQOptions(static_groups=True))])
def test_dequantize_is_gptq_result(rule, cfg):
    w, x = _weight(5, dtype=torch.bfloat16), _inputs(5)
    spec = NVFP4(rule)
    S = _S(w, spec)
    Q, *_ = _gptq(w, _hessian(x), spec, S, cfg)
    q, _ = gptq_quantize(w, _hessian(x), spec, S, cfg)
    assert q.dtype == torch.bfloat16 and q.shape == w.shape
    assert q.codes.shape == (N, K // 2) and q.codes.dtype == torch.uint8
    assert q.scales.shape == (N, K // 16) and q.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(q.dequantize(), Q)
    s = q.scales.float()
    assert torch.isfinite(s).all() and (s >= 0).all() and (s <= 448).all()
    # every nibble decodes to an E2M1 value and |value| <= 6; reconstructing from the grid agrees
    codes = unpack_nibbles(q.codes).long()
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    vals = grid[codes].view(N, K // 16, 16)
    assert float(vals.abs().max()) <= 6.0
    assert torch.equal(((vals * s.unsqueeze(-1)) * (1.0 / S)).view(N, K), Q)


def test_deterministic_and_device_agnostic_inputs():
    w, x = _weight(6), _inputs(6)
    H, spec = _hessian(x), NVFP4("4over6")
    S = _S(w, spec)
    a, _ = gptq_quantize(w, H, spec, S)
    b, _ = gptq_quantize(w, H.double(), spec, float(S))  # fp64 H and a python float S are accepted
    _assert_same_qtensor(a, b)


def test_speed_1536x576():
    w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))
    x = _inputs(0, k=576, t=1024)
    spec = NVFP4("6")
    _, st = gptq_quantize(w, _hessian(x), spec, _S(w, spec))
    assert st["seconds"] < 2.0  # about 0.13 s measured on one core


# ---------------------------------------------------------------------------------------------
# 4. input checks


def test_errors():
    w, H = _weight(0), torch.eye(K)
    spec = NVFP4("6")
    S = _S(w, spec)
    with pytest.raises(ValueError, match="multiple of 16"):
        gptq_quantize(w[:, :120], torch.eye(120), spec, S)
    with pytest.raises(ValueError, match=r"H has shape \(64, 64\)"):
        gptq_quantize(w, torch.eye(64), spec, S)
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize(w[0], H, spec, S)
    with pytest.raises(TypeError, match="NVFP4"):
        gptq_quantize(w, H, MX("e2m1"), S)
    with pytest.raises(ValueError, match="rounding"):
        gptq_quantize(w, H, NVFP4("6", rounding="stochastic"), S)
    with pytest.raises(ValueError, match="encode_scale"):
        gptq_quantize(w, H, spec, torch.tensor(0.0))
    with pytest.raises(ValueError, match="encode_scale"):
        gptq_quantize(w, H, spec, torch.ones(2))
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, torch.full((K, K), float("nan")), spec, S)
    with pytest.raises(ValueError, match="positive definite"):
        gptq_quantize(w, -torch.eye(K), spec, S, GPTQOptions(damp=0.0))


@pytest.mark.parametrize("kwargs,field", [
    ({"damp": -0.1}, "damp"), ({"damp": float("nan")}, "damp"), ({"damp": "0.01"}, "damp"),
    ({"block_size": 100}, "block_size"), ({"block_size": 0}, "block_size"), ({"block_size": 64.0}, "block_size"),
    ({"act_order": 1}, "act_order"), ({"static_groups": "yes"}, "static_groups"),
    ({"four_over_six": "both"}, "four_over_six"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTQOptions(**kwargs)


# ---------------------------------------------------------------------------------------------
# 5. Hessian accumulation


def test_hessian_accumulator_running_mean():
    x = _inputs(7, t=300)
    acc = HessianAccumulator(K)
    acc.add(x[:17])
    acc.add(x[17:117].view(4, 25, K))  # leading dims are tokens
    acc.add(x[117:117])  # empty chunk: no change
    acc.add(x[117:].to(torch.bfloat16).float())
    xr = torch.cat((x[:117], x[117:].to(torch.bfloat16).float()))
    ref = (2.0 / 300) * (xr.double().T @ xr.double())
    assert acc.n_tokens == 300
    assert torch.allclose(acc.H.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    acc64 = HessianAccumulator(K, dtype=torch.float64)
    for c in xr.split(64):
        acc64.add(c)
    assert torch.allclose(acc64.H, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="in_features"):
        acc.add(torch.randn(3, K + 1))
    with pytest.raises(ValueError, match="in_features"):
        HessianAccumulator(0)
