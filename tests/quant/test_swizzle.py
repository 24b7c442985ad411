"""cuBLAS / CUTLASS 128x4 block-scale swizzle: layout formula, padding and round trip."""
from __future__ import annotations

import pytest
import torch

import blockscale as bs

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(128, 4), (256, 8), (130, 5), (3, 1), (2, 200, 6), (1, 128, 4), (2, 3, 129, 9)]
DTYPES = [torch.uint8, torch.float8_e4m3fn]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make(shape, dtype, seed=0, nonzero=True) -> torch.Tensor:
    """Random bytes (1..255 when ``nonzero``, so padding zeros are distinguishable) as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    lo = 1 if nonzero else 0
    raw = torch.randint(lo, 256, shape, generator=g, dtype=torch.uint8)
    return raw if dtype == torch.uint8 else raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def swizzle_by_formula(s: torch.Tensor) -> torch.Tensor:
    """Element by element from the spec: tile (i, j) at (i*ceil(K/4) + j)*512, then
    (r % 32)*16 + (r // 32)*4 + c inside the 128x4 tile. 2-D byte input."""
    m, k = s.shape
    kt = ceil_div(k, 4)
    out = torch.zeros(ceil_div(m, 128) * 128 * kt * 4, dtype=torch.uint8)
    flat = []
    for row in range(m):
        i, r = divmod(row, 128)
        for col in range(k):
            j, c = divmod(col, 4)
            flat.append((i * kt + j) * 512 + (r % 32) * 16 + (r // 32) * 4 + c)
    idx = torch.tensor(flat, dtype=torch.long)
    out[idx] = s.reshape(-1)
    return out


def swizzle_by_view(s: torch.Tensor) -> torch.Tensor:
    """Spec's reference: pad to (128, 4) multiples, view(M/128, 4, 32, K/4, 4).permute(0, 3, 2, 1, 4)."""
    m, k = s.shape
    mp, kp = ceil_div(m, 128) * 128, ceil_div(k, 4) * 4
    p = torch.zeros(mp, kp, dtype=torch.uint8)
    p[:m, :k] = s
    return p.view(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip(shape, dtype):
    s = make(shape, dtype)
    *lead, m, k = shape
    z = bs.swizzle_scales(s)
    assert z.dtype == dtype
    assert z.shape == (*lead, ceil_div(m, 128) * 128 * ceil_div(k, 4) * 4)
    back = bs.unswizzle_scales(z, m, k)
    assert back.dtype == dtype and back.shape == s.shape
    assert torch.equal(as_bytes(back), as_bytes(s))


def test_single_tile_index_formula():
    # distinct ids: element (r, c) holds r*4 + c (as int32, so all 512 values are distinct)
    s = torch.arange(512, dtype=torch.int32).reshape(128, 4)
    z = bs.swizzle_scales(s)
    assert z.shape == (512,)
    for r in range(128):
        for c in range(4):
            assert z[(r % 32) * 16 + (r // 32) * 4 + c].item() == r * 4 + c


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (130, 5), (3, 1), (200, 6), (384, 3), (129, 13)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_spec_formula_and_view(shape, dtype):
    s = make(shape, dtype, seed=shape[0] + shape[1])
    b = as_bytes(s)
    z = as_bytes(bs.swizzle_scales(s))
    assert torch.equal(z, swizzle_by_formula(b))
    assert torch.equal(z, swizzle_by_view(b))


@pytest.mark.parametrize("shape", [(130, 5), (3, 1), (200, 6), (129, 13)], ids=str)
def test_padding_entries_are_zero(shape):
    s = make(shape, torch.float8_e4m3fn, nonzero=True)  # every real entry is a non-zero byte
    m, k = shape
    z = as_bytes(bs.swizzle_scales(s))
    n_pad = z.numel() - m * k
    assert n_pad > 0
    assert int((z == 0).sum()) == n_pad
    # and exactly the positions the formula leaves empty
    mask = swizzle_by_formula(torch.ones(m, k, dtype=torch.uint8))
    assert torch.equal(z == 0, mask == 0)


def test_multi_tile_row_major_order():
    # tile (i, j) holds constant value 1 + i*ceil(K/4) + j; it must start at (i*ceil(K/4) + j)*512
    m, k = 256, 12
    kt = k // 4
    s = torch.zeros(m, k, dtype=torch.uint8)
    for i in range(m // 128):
        for j in range(kt):
            s[i * 128:(i + 1) * 128, j * 4:(j + 1) * 4] = 1 + i * kt + j
    z = bs.swizzle_scales(s)
    for t in range(z.numel() // 512):
        assert bool((z[t * 512:(t + 1) * 512] == t + 1).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_is_per_leading_index(dtype):
    s = make((2, 200, 6), dtype, seed=5)
    z = bs.swizzle_scales(s)
    assert z.shape == (2, 256 * 8)
    for e in range(2):
        assert torch.equal(as_bytes(z[e]), as_bytes(bs.swizzle_scales(s[e])))
        assert torch.equal(as_bytes(z[e]), swizzle_by_view(as_bytes(s[e])))
    s4 = make((3, 2, 130, 5), dtype, seed=6)
    z4 = bs.swizzle_scales(s4)
    assert z4.shape == (3, 2, 256 * 8)
    assert torch.equal(as_bytes(z4[2, 1]), swizzle_by_formula(as_bytes(s4[2, 1])))


def test_non_contiguous_input():
    s = make((8, 256), torch.uint8, seed=3).T  # (256, 8) with transposed strides
    assert not s.is_contiguous()
    assert torch.equal(bs.swizzle_scales(s), swizzle_by_view(s.contiguous()))


def test_float8_values_preserved():
    s = torch.tensor([[1.0, 2.0, 0.5, 448.0, -3.0]]).to(torch.float8_e4m3fn)
    z = bs.swizzle_scales(s)
    assert z.dtype == torch.float8_e4m3fn
    back = bs.unswizzle_scales(z, 1, 5)
    assert back.float().tolist() == [[1.0, 2.0, 0.5, 448.0, -3.0]]
    assert z.float()[:4].tolist() == [1.0, 2.0, 0.5, 448.0]  # row 0 of tile 0: offsets 0..3; col 4 is in tile 1
    assert z.float()[4].item() == 0.0 and z.float()[512].item() == -3.0


def test_unswizzle_wrong_length_raises():
    z = bs.swizzle_scales(make((130, 5), torch.uint8))
    with pytest.raises(ValueError):
        bs.unswizzle_scales(z[:-1], 130, 5)
    with pytest.raises(ValueError):
        bs.unswizzle_scales(z, 130, 9)
    with pytest.raises(ValueError):
        bs.unswizzle_scales(z, 300, 5)
    with pytest.raises(ValueError):
        bs.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 3, 1)
    # any (rows, cols) with the same padded size is fine
    assert bs.unswizzle_scales(z, 256, 8).shape == (256, 8)


def test_swizzle_needs_2d():
    with pytest.raises(ValueError):
        bs.swizzle_scales(torch.zeros(16, dtype=torch.uint8))


def test_quantized_tensor_scales_swizzled():
    x = torch.randn(130, 80, generator=torch.Generator().manual_seed(0))
    with bs.use_backend("reference"):
        q = bs.quantize(x, bs.NVFP4())
    z = q.scales_swizzled()
    assert q.scales.shape == (130, 5)
    assert torch.equal(as_bytes(z), swizzle_by_formula(as_bytes(q.scales)))
    assert torch.equal(as_bytes(bs.unswizzle_scales(z, 130, 5)), as_bytes(q.scales))
