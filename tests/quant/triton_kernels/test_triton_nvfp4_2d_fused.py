"""Triton NVFP4 16x16 tiles, swizzled scale output, and the fused NVFP4 -> MXFP8-transposed
backward kernel == the PyTorch reference, bit for bit (codes, scale bytes, values via int32 views).

Same interpreter setup as tests/quant/triton_kernels/test_triton_kernels.py: TRITON_INTERPRET=1 before ``import triton``
on CPU-only machines (a fresh process reruns the file if triton was imported without it); on a GPU
the kernels run on CUDA tensors against the CPU reference.
"""

import pytest
import torch

import triton_interpreter  # noqa: E402  (sets TRITON_INTERPRET before triton is imported)
from triton_interpreter import DEV, ON_GPU  # noqa: E402

import blockscale as bs  # noqa: E402
from blockscale.nn import QuantizedLinear  # noqa: E402
from blockscale.nn import gemm as gemm_mod  # noqa: E402
from blockscale.quant.transforms import requantize_transposed as fused  # noqa: E402
from blockscale.quant import nvfp4 as ref  # noqa: E402
from blockscale.quant.block_error import tile_error  # noqa: E402
from blockscale.quant.dispatch import quantize_with_values  # noqa: E402
from blockscale.quant.transforms.swizzle import swizzle_scales  # noqa: E402
from blockscale.quant.blocking import triton_seed  # noqa: E402
from blockscale.quant.triton_kernels import requantize_transposed_triton as ft  # noqa: E402
from blockscale.quant.triton_kernels import nvfp4_triton as nt  # noqa: E402
from blockscale.recipes import LinearRecipe  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


_skip_when_rerun = triton_interpreter._skip_when_rerun  # autouse fixture
test_rerun_in_a_fresh_interpreter = triton_interpreter.test_rerun_in_a_fresh_interpreter


def _i32(t):
    return t.contiguous().view(torch.int32)


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _hard(shape=(40, 72), seed=0):
    """Wide dynamic range along K, a zero tile, an all -0.0 tile, ±0 inside tiles, a tiny tile next
    to huge ones, an FP32-subnormal tile; M and K not multiples of 16."""
    g = torch.Generator().manual_seed(seed)
    *lead, M, K = shape
    x = torch.randn(*lead, M, K, generator=g) * torch.logspace(-4, 4, K)
    x2 = x.view(-1, M, K)
    x2[0, :16, :16] = 0.0  # zero tile
    x2[0, :16, 16:32] = -0.0  # ±0 tiles
    x2[0, 16:32, 16:32] *= 1e-25  # tiny tile next to huge ones
    x2[0, 3, 32:40] = torch.tensor([-0.0, 0.0, -0.0, 1e-40, -1e-42, 0.0, -0.0, 5e-45])
    if M >= 32 and K >= 64:
        x2[-1, 16:32, 48:64] = torch.randn(16, 16, generator=g) * 1e-39  # FP32-subnormal tile
    x2[-1, -1, :8] = torch.tensor([10.0, 20, 30, 40, -10, -20, -30, -40])
    return x


def _reference(x, spec, rand_bits=None):
    with bs.use_backend("reference"):
        return ref.quantize_nvfp4(x, spec, outputs="both", rand_bits=rand_bits)


def _check_tiles(x, spec, seed=0, offset=0):
    """16x16 tile kernel vs reference: codes, scale bytes (plain and swizzled), values."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    B, M, K = x3.shape
    Mp, Kp = -(-M // 16) * 16, -(-K // 16) * 16
    bits = nt.random_bits(B * Mp * Kp, seed, offset, DEV).cpu() if spec.rounding == "stochastic" else None
    q, v = _reference(x, spec, bits)
    S_rows = ref.outer_scales(x3, spec, x.shape)[2]
    args = (S_rows.to(DEV), spec.scale_rule, spec.error, spec.rounding, spec.sr_mode, seed, offset)
    codes, sbytes, values = (t.cpu() for t in nt.quantize_nvfp4_tiles(x3.to(DEV), *args, want_values=True))
    assert torch.equal(codes, q.codes.reshape(B * M, -1)), "codes"
    assert torch.equal(sbytes, _u8(q.scales).reshape(B * M, -1)), "scales"
    assert torch.equal(_i32(values[:, :K]), _i32(v.reshape(B * M, K))), "values"
    sw = nt.quantize_nvfp4_tiles(x3.to(DEV), *args, want_codes=False, scale_layout="swizzled")[1].cpu()
    assert torch.equal(sw, _u8(swizzle_scales(q.scales.reshape(B, M, -1))).reshape(-1)), "swizzled scales"
    return q


RULES = [("6", "mse"), ("4", "mse"), ("4over6", "mse"), ("4over6", "mae"), ("4over6", "maxabs")]


@pytest.mark.parametrize("rule, error", RULES)
def test_tiles_nearest_match_reference(rule, error):
    spec = bs.NVFP4(scale_rule=rule, error=error, block_2d=True)
    x = _hard()
    q = _check_tiles(x, spec)
    _check_tiles(x.to(torch.bfloat16), spec)
    _check_tiles(_hard((3, 20, 40), seed=1), bs.NVFP4(scale_rule=rule, error=error, block_2d=True, outer="group"))
    if rule == "4over6":  # both candidates really occur (s4 > s6 bytes differ from the rule-6 ones)
        q6, _ = _reference(x, bs.NVFP4(block_2d=True, outer=float(x.abs().max()) * 448 / 256))
        assert not torch.equal(_u8(q.scales), _u8(q6.scales))


def _tiny_16bit(dtype, shape=(2, 20, 40), seed=0):
    """``dtype`` (bf16 / fp16) tensor of tiny values only, nearly all subnormal in ``dtype`` (bf16:
    FP32 subnormals such as 1e-38 and -3e-39), so each tile gets its own small E4M3 scale and they
    survive quantization; zeros, -0.0, the smallest normal and subnormal included; M, K % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    if dtype == torch.bfloat16:
        unit, special = 4e-39, [1e-38, -3e-39, 2.5e-38, -7.5e-39, -0.0, 0.0]
    else:
        unit, special = 2e-5, [6e-5, -3e-5, 1.2e-4, -7.5e-6, -0.0, 0.0]
    x = torch.randn(*shape, generator=g) * unit
    x[0, 0, :6] = torch.tensor(special)
    x[-1, 17, 16:18] = torch.tensor([fi.smallest_normal, -fi.smallest_normal * fi.eps])  # smallest subnormal
    return x.to(dtype)


# S = FLT_MAX for the bf16 tensors: 1 / (s * inv_S) overflows to inf (then FLT_MAX), and numpy says so
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("outer", ["tensor", "group"])  # block_2d has no "row"
@pytest.mark.parametrize("rule, error", [("6", "mse"), ("4over6", "mse"), ("4over6", "maxabs")])
def test_tiles_16bit_subnormal_inputs_load_exactly(dtype, outer, rule, error):
    """bf16 / fp16 inputs holding subnormals of their own format: the tile kernel must see their exact
    FP32 values (Triton's interpreter converts bf16 subnormals wrongly with ``.to(tl.float32)``)."""
    x = _tiny_16bit(dtype)
    assert bool((x.float().abs() < torch.finfo(dtype).smallest_normal).any())
    q = _check_tiles(x, bs.NVFP4(scale_rule=rule, error=error, block_2d=True, outer=outer))
    with bs.use_backend("reference"):
        v = q.dequantize()
    sub = (x.float().abs() < torch.finfo(dtype).smallest_normal) & (x != 0)
    assert int((v != 0).sum()) > 800 and int((v[sub] != 0).sum()) > 200  # not flushed by the quantization


def test_tile_error_order_decides_near_ties():
    """The nearest 4/6 ties among integer tiles, including one where a plain sequential FP32 sum
    would flip the choice made in ``tile_error``'s order (V + V^T, pairwise tree): the kernel
    picks what the reference picks."""
    g = torch.Generator().manual_seed(0)
    n = 4000
    x = torch.randint(-40, 41, (n, 16, 16), generator=g).float()
    S = ref.outer_scale(x.abs().amax(), 256.0)
    t = x.abs().amax(dim=(-2, -1), keepdim=True) * (S * (1.0 / 6.0))
    d6, d4 = (ref.reconstruct_blocks(x, s, 1.0 / S, None, "nearest", "hardware") - x
              for s in (ref.e4m3_scale(t), ref.e4m3_scale(t * 1.5)))
    e6, e4 = tile_error(d6, "mse"), tile_error(d4, "mse")
    seq = lambda d: (d * d).reshape(n, 256).cumsum(-1)[:, -1]  # noqa: E731
    flip = (e4 < e6) != (seq(d4) < seq(d6))
    near = torch.argsort((e4 - e6).abs() / e6)[:12]
    pick = torch.unique(torch.cat([flip.nonzero().reshape(-1), near]))
    assert int(flip.sum()) >= 1 and pick.numel() <= 16
    xx = x[pick].transpose(0, 1).reshape(16, -1)  # the tiles side by side along K
    spec = bs.NVFP4(scale_rule="4over6", block_2d=True, outer=float(x.abs().amax()))
    _check_tiles(xx, spec)
    q, _ = _reference(xx, spec)
    assert 0 < int((_u8(q.scales)[0].reshape(-1) != _u8(ref.e4m3_scale(t[pick]).reshape(-1).to(torch.float8_e4m3fn))).sum())


@pytest.mark.parametrize("rule, error", [("6", "mse"), ("4", "mse"), ("4over6", "mse"), ("4over6", "maxabs")])
@pytest.mark.parametrize("sr_mode", ["hardware", "exact"])
def test_tiles_stochastic_rounding_consumes_the_same_bits(rule, error, sr_mode):
    spec = bs.NVFP4(scale_rule=rule, error=error, block_2d=True, rounding="stochastic", sr_mode=sr_mode)
    _check_tiles(_hard((2, 20, 40), seed=2), spec, seed=1234)
    _check_tiles(_hard((36, 50), seed=3), spec, seed=7, offset=2**32 - 300)  # counter wraps mod 2**32


def test_tiles_transpose_commutes():
    """16x16 tiles: dequantize(W).T == dequantize of W.T's quantization, through the kernel."""
    x = _hard((48, 64), seed=4)
    spec = bs.NVFP4(scale_rule="4over6", block_2d=True)
    with bs.use_backend("triton"):
        a = bs.quantize(x.to(DEV), spec).to("cpu")
        b = bs.quantize(x.t().contiguous().to(DEV), spec).to("cpu")
    with bs.use_backend("reference"):
        assert torch.equal(_i32(a.dequantize().t()), _i32(b.dequantize()))


def test_swizzled_scales_of_1x16_kernel():
    """1x16 blocks: scale_layout="swizzled" == swizzle_scales(reference scales), per leading index."""
    x = _hard((2, 130, 88), seed=5)  # 2 row tiles of 128 per batch, nb = 6 -> 2 column tiles
    spec = bs.NVFP4(scale_rule="4over6", outer="row")
    q, _ = _reference(x, spec)
    S = q.outer_scale.reshape(-1).to(DEV)
    sw = nt.quantize_nvfp4_2d(x.reshape(-1, 88).to(DEV), S, "4over6", want_codes=False, scale_layout="swizzled",
                              rows_per_batch=130)[1].cpu()
    assert torch.equal(sw, _u8(swizzle_scales(q.scales)).reshape(-1))
    assert torch.equal(sw, _u8(q.scales_swizzled()).reshape(-1))
    flat = nt.quantize_nvfp4_2d(x.reshape(-1, 88).to(DEV), S, "4over6", want_codes=False,
                                scale_layout="swizzled")[1].cpu()  # one [260, 6] matrix
    assert torch.equal(flat, _u8(swizzle_scales(q.scales.reshape(260, -1))))
    with pytest.raises(ValueError, match="scale_layout"):
        nt.quantize_nvfp4_2d(x[0].to(DEV), S[:1], scale_layout="tiled")


@pytest.mark.parametrize("spec", [bs.NVFP4(block_2d=True), bs.NVFP4(scale_rule="4over6", block_2d=True, outer="group"),
                                  bs.NVFP4(scale_rule="4", block_2d=True, outer=30.0)], ids=str)
def test_backend_triton_dispatches_tiles(spec, monkeypatch):
    calls = []
    orig = nt.quantize_nvfp4_tiles
    monkeypatch.setattr(nt, "quantize_nvfp4_tiles", lambda *a, **k: calls.append(1) or orig(*a, **k))
    x = _hard((2, 20, 40), seed=6)
    for xi in (x, x.to(torch.bfloat16)):
        with bs.use_backend("triton"):
            q, v = quantize_with_values(xi.to(DEV), spec)
            f = bs.fake_quantize(xi.to(DEV), spec)
        qr, vr = _reference(xi, spec)
        assert torch.equal(q.codes.cpu(), qr.codes) and torch.equal(_u8(q.scales.cpu()), _u8(qr.scales))
        assert torch.equal(_i32(q.outer_scale.cpu()), _i32(qr.outer_scale)) and q.shape == qr.shape
        assert torch.equal(_i32(v.cpu()), _i32(vr))
        assert torch.equal(f.cpu().float().view(torch.int32), vr.to(xi.dtype).float().view(torch.int32))
    assert len(calls) == 4
    assert ref.triton_supports(spec) and not ref.triton_supports(bs.NVFP4(scale_rule="sweep", block_2d=True))


# ---- fused NVFP4 [M, K] -> MX of the dequantized transpose [K, M] ----

def _nvfp4(x, spec):
    with bs.use_backend("reference"):
        return bs.quantize(x, spec)


def _check_fused(q, mx, seed=0, offset=0):
    M, K = q.shape
    Mp = -(-M // 32) * 32
    bits = nt.random_bits(K * Mp, seed, offset, DEV).cpu() if mx.rounding == "stochastic" else None
    with bs.use_backend("reference"):
        qt, v = fused.nvfp4_to_mx_transposed_reference(q, mx, rand_bits=bits, outputs="both")
        # the definition, spelled out: quantize(dequantize(q).t()) for round-to-nearest
        if mx.rounding == "nearest":
            want = bs.quantize(q.dequantize().t().contiguous(), mx)
            assert torch.equal(_u8(qt.codes), _u8(want.codes)) and torch.equal(qt.scales, want.scales)
    inv_s = (1.0 / q.outer_scale).expand(M, 1).reshape(M) if q.outer_scale.dim() else 1.0 / q.outer_scale
    qd = q.to(DEV)
    codes, scales, values = (t.cpu() for t in ft.nvfp4_to_mx_t(
        qd.codes, qd.scales, inv_s.to(DEV), K, mx.element, mx.scale_rule, mx.rounding, mx.sr_mode, seed, offset,
        want_values=True))
    assert codes.dtype == qt.codes.dtype and codes.shape == (K, Mp)
    assert torch.equal(_u8(codes), _u8(qt.codes)), "codes"
    assert torch.equal(scales, qt.scales), "scales"
    assert torch.equal(_i32(values[:, :M]), _i32(v)), "values"
    with bs.use_backend("reference"):
        assert torch.equal(_i32(qt.dequantize()), _i32(v))


NV_SPECS = [bs.NVFP4(), bs.NVFP4(scale_rule="4over6", outer="row"), bs.NVFP4(block_2d=True)]


@pytest.mark.parametrize("nv", NV_SPECS, ids=str)
@pytest.mark.parametrize("mode", ["hardware", "exact", "nearest"])
def test_fused_matches_reference(nv, mode):
    mx = bs.MX(element="e4m3", rounding="nearest") if mode == "nearest" else bs.MX(
        element="e4m3", rounding="stochastic", sr_mode=mode)
    q = _nvfp4(_hard((70, 90), seed=7), nv)  # M % 32 != 0, K % 16 != 0
    _check_fused(q, mx, seed=99)
    _check_fused(_nvfp4(torch.randn(64, 48, generator=torch.Generator().manual_seed(8)), nv), mx, seed=5,
                 offset=2**32 - 1000)


@pytest.mark.parametrize("element, rule", [("e5m2", "ceil"), ("e4m3", "floor"), ("e5m2", "floor")])
def test_fused_other_elements_and_rules(element, rule):
    q = _nvfp4(_hard((40, 50), seed=9), bs.NVFP4(scale_rule="4over6"))
    _check_fused(q, bs.MX(element=element, scale_rule=rule, rounding="stochastic"), seed=3)
    _check_fused(q, bs.MX(element=element, scale_rule=rule), seed=3)


def test_fused_edge_cases():
    """Zero operand, all -0.0, a tiny block next to huge ones, E4M3-subnormal NVFP4 scales."""
    mx = bs.MX(element="e4m3", rounding="stochastic")
    _check_fused(_nvfp4(torch.zeros(33, 16), bs.NVFP4()), mx)
    _check_fused(_nvfp4(-torch.zeros(5, 20), bs.NVFP4()), mx)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(10))
    x[:32, :16] *= 1e-30
    x[32:, 16:] *= 1e6
    x[0, :4] = torch.tensor([-0.0, 0.0, 1e-45, -1e-45])
    _check_fused(_nvfp4(x, bs.NVFP4()), mx, seed=4)
    _check_fused(_nvfp4(x, bs.NVFP4(outer="row")), bs.MX(element="e4m3"))


def test_fused_dispatch_seeds_from_the_generator():
    x = _hard((40, 48), seed=11)
    q = _nvfp4(x, bs.NVFP4(scale_rule="4over6", outer="row"))
    mx = bs.MX(element="e4m3", rounding="stochastic")
    assert not fused.fused_supported(q, mx) or ON_GPU  # backend "reference": never the kernel on CPU
    with bs.use_backend("triton"):
        assert fused.fused_supported(q.to(DEV), mx)
        got, v = fused.nvfp4_to_mx_transposed(q.to(DEV), mx, torch.Generator().manual_seed(3), outputs="both")
    seed = triton_seed(torch.Generator().manual_seed(3), torch.device("cpu"))
    bits = nt.random_bits(48 * 64, seed, device=DEV).cpu()
    with bs.use_backend("reference"):
        want, wv = fused.nvfp4_to_mx_transposed(q, mx, rand_bits=bits, outputs="both")
    assert got.shape == want.shape == (48, 40) and got.dtype == want.dtype
    assert torch.equal(_u8(got.codes.cpu()), _u8(want.codes)) and torch.equal(got.scales.cpu(), want.scales)
    assert torch.equal(_i32(v.cpu()), _i32(wv))
    with pytest.raises(ValueError, match="MX spec"):
        fused.nvfp4_to_mx_transposed(q, bs.MX(dim=0))


@pytest.mark.parametrize("gemm_backend", ["emulated", "needs_codes"])
def test_training_backward_uses_the_fused_kernel(gemm_backend, monkeypatch):
    """NVFP4 forward / MXFP8 (RNE) backward: backend "triton" (fused kernel for W^T in dgrad and
    x^T in wgrad) gives the reference backend's gradients bit for bit."""
    calls = []
    orig = ft.nvfp4_to_mx_t
    monkeypatch.setattr(ft, "nvfp4_to_mx_t", lambda *a, **k: calls.append(1) or orig(*a, **k))
    gemm_mod.register_gemm_backend("needs_codes", gemm_mod.emulated_gemm, needs_codes=True)
    mx = bs.MX(element="e4m3")
    r = LinearRecipe(fprop_input=bs.NVFP4(scale_rule="4over6", outer="row"), fprop_weight=bs.NVFP4(),
                     dgrad_grad=mx, dgrad_weight=mx, wgrad_grad=mx, wgrad_input=mx)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(40, 48, generator=g)
    dy = torch.randn(40, 32, generator=g)
    lin = torch.nn.Linear(48, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 48, generator=g) * 0.1)
    grads = {}
    gemm_mod.set_gemm_backend(gemm_backend)
    try:
        for backend in ("triton", "reference"):
            layer = QuantizedLinear.from_linear(lin, r).to(DEV if backend == "triton" else "cpu")
            x = (x0.to(DEV) if backend == "triton" else x0.clone()).detach().requires_grad_(True)
            with bs.use_backend(backend):
                layer(x).backward(dy.to(x.device))
            grads[backend] = (x.grad.cpu(), layer.weight.grad.cpu())
            layer.weight.grad = None
    finally:
        gemm_mod.set_gemm_backend("emulated")
    assert len(calls) == 2  # dgrad W^T and wgrad x^T
    for a, b in zip(grads["triton"], grads["reference"]):
        assert torch.equal(_i32(a), _i32(b))
