"""Random Hadamard transform: x' = x_blocks @ (diag(s) . H_n / sqrt(n)), Sylvester H_n.

The reference is an independent float64 matrix product; the tolerance is a first-order bound on
the FP32 rounding of a log2(n)-stage butterfly plus the final scale multiply:
|y_j - ref_j| <= (log2 n + 3) * 2^-24 * ||x_block||_2.
"""
from __future__ import annotations

import math

import pytest
import torch

import blockscale as bs

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (16, 32, 64, 128)
U = 2.0 ** -24
SPEC_TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def sylvester64(n: int) -> torch.Tensor:
    """H_n in float64 from the Kronecker definition H_2n = [[H, H], [H, -H]]."""
    h = torch.tensor([[1.0]], dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(base, h)
    return h


def sylvester_entry(i: int, j: int) -> int:
    """(-1)^popcount(i & j): the closed form of Sylvester's construction."""
    return -1 if bin(i & j).count("1") % 2 else 1


def reference(x: torch.Tensor, n: int, signs, dim: int) -> torch.Tensor:
    xd = x.double().movedim(dim, -1)
    s = torch.ones(n, dtype=torch.float64) if signs is None else torch.as_tensor(signs, dtype=torch.float64)
    m = torch.diag(s) @ sylvester64(n) / math.sqrt(n)
    blocks = xd.reshape(*xd.shape[:-1], -1, n)
    return (blocks @ m).reshape(xd.shape).movedim(-1, dim)


def block_norms(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """||x_block||_2 broadcast back to every element of its block (float64)."""
    xd = x.double().movedim(dim, -1)
    b = xd.reshape(*xd.shape[:-1], -1, n)
    nrm = b.norm(dim=-1, keepdim=True).expand_as(b)
    return nrm.reshape(xd.shape).movedim(-1, dim)


def tol(n: int) -> float:
    return (math.log2(n) + 3) * U


def signs_for(n: int, kind: str):
    if kind == "none":
        return None
    if kind == "te":
        return bs.TE_SIGNS_16 if n == 16 else None
    return bs.random_signs(n, seed=n + 1)


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# the matrix itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_matrix_is_sylvester(n):
    h = bs.hadamard_matrix(n)
    assert h.shape == (n, n)
    assert h.dtype == torch.float32
    expected = torch.tensor([[sylvester_entry(i, j) for j in range(n)] for i in range(n)], dtype=torch.float32)
    assert torch.equal(h, expected)
    assert torch.equal(h.double(), sylvester64(n))


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_matrix_orthogonal_exactly(n):
    h = bs.hadamard_matrix(n)
    # integer entries, sums <= 128: exact in FP32
    assert torch.equal(h @ h.T, n * torch.eye(n))
    assert torch.equal(h, h.T)


# --------------------------------------------------------------------------------------------
# forward transform against the float64 reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["none", "random", "te"])
def test_hadamard_matches_reference_last_dim(n, kind):
    signs = signs_for(n, kind)
    x = _rand((3, 5, 4 * n), seed=n)
    y = bs.hadamard(x, n, signs=signs)
    assert y.dtype == torch.float32 and y.shape == x.shape
    ref = reference(x, n, signs, -1)
    err = (y.double() - ref).abs()
    assert bool((err <= tol(n) * block_norms(x, n, -1)).all()), err.max().item()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["none", "random"])
def test_hadamard_matches_reference_dim0(n, kind):
    signs = signs_for(n, kind)
    x = _rand((2 * n, 7), seed=3 * n)
    y = bs.hadamard(x, n, signs=signs, dim=0)
    assert y.shape == x.shape
    ref = reference(x, n, signs, 0)
    err = (y.double() - ref).abs()
    assert bool((err <= tol(n) * block_norms(x, n, 0)).all()), err.max().item()
    # same thing as transposing, transforming the last dim and transposing back (bit for bit)
    assert torch.equal(y, bs.hadamard(x.T.contiguous(), n, signs=signs).T)


def test_hadamard_middle_dim_of_3d():
    n = 32
    signs = bs.random_signs(n, seed=9)
    x = _rand((3, 64, 5), seed=1)
    y = bs.hadamard(x, n, signs=signs, dim=1)
    ref = reference(x, n, signs, 1)
    assert bool(((y.double() - ref).abs() <= tol(n) * block_norms(x, n, 1)).all())
    assert torch.equal(y, bs.hadamard(x, n, signs=signs, dim=-2))


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_of_identity_is_the_transform_matrix(n):
    """Rows of I_n map to the rows of diag(s) H_n / sqrt(n): pins the convention (signs on the input side)."""
    signs = bs.random_signs(n, seed=123)
    y = bs.hadamard(torch.eye(n), n, signs=signs)
    m = torch.diag(signs.double()) @ sylvester64(n) / math.sqrt(n)
    assert bool(((y.double() - m).abs() <= tol(n)).all())
    # entries are ±FP32(1/sqrt(n)) exactly: one multiply of ±1 values
    assert torch.equal(y.abs(), torch.full((n, n), 1.0 / math.sqrt(n), dtype=torch.float32))


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_float64(n):
    signs = bs.random_signs(n, seed=5)
    x = _rand((4, 2 * n), seed=11, dtype=torch.float64)
    y = bs.hadamard(x, n, signs=signs)
    assert y.dtype == torch.float64
    ref = reference(x, n, signs, -1)
    assert bool(((y - ref).abs() <= 1e-14 * block_norms(x, n, -1)).all())
    back = bs.inverse_hadamard(y, n, signs=signs)
    assert bool(((back - x).abs() <= 1e-14 * block_norms(x, n, -1)).all())


def test_hadamard_blocks_are_independent():
    n = 16
    x = _rand((2, 4 * n), seed=2)
    y = bs.hadamard(x, n)
    for b in range(4):
        sl = slice(b * n, (b + 1) * n)
        assert torch.equal(y[:, sl], bs.hadamard(x[:, sl].contiguous(), n))


# --------------------------------------------------------------------------------------------
# orthogonality: norm preservation and inverse
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["none", "random"])
def test_hadamard_preserves_block_norm(n, kind):
    signs = signs_for(n, kind)
    x = _rand((64, 2 * n), seed=7)
    y = bs.hadamard(x, n, signs=signs)
    nx = x.double().reshape(64, 2, n).norm(dim=-1)
    ny = y.double().reshape(64, 2, n).norm(dim=-1)
    # ||err||_2 <= sqrt(n) * max|err_j|, each |err_j| <= tol * ||x||
    assert bool(((ny - nx).abs() <= math.sqrt(n) * tol(n) * nx).all()), ((ny - nx).abs() / nx).max().item()
    # and typically far tighter than the worst case
    assert ((ny - nx).abs() / nx).max().item() < 2e-6


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["none", "random", "te"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_inverse_undoes_forward(n, kind, dim):
    signs = signs_for(n, kind)
    shape = (3, 2 * n) if dim == -1 else (2 * n, 3)
    x = _rand(shape, seed=n + 17)
    y = bs.hadamard(x, n, signs=signs, dim=dim)
    back = bs.inverse_hadamard(y, n, signs=signs, dim=dim)
    assert back.dtype == torch.float32 and back.shape == x.shape
    err = (back.double() - x.double()).abs()
    bound = 2 * tol(n) * block_norms(x, n, dim)  # <= 1.2e-6 of the block norm for n = 128
    assert bool((err <= bound).all()), (err / block_norms(x, n, dim)).max().item()
    # forward(inverse(y)) too
    again = bs.hadamard(bs.inverse_hadamard(x, n, signs=signs, dim=dim), n, signs=signs, dim=dim)
    assert bool(((again.double() - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("n", SIZES)
def test_inverse_matches_reference(n):
    signs = bs.random_signs(n, seed=2)
    x = _rand((4, 2 * n), seed=8)
    y = bs.inverse_hadamard(x, n, signs=signs)
    # inverse = transpose of diag(s) H / sqrt(n) = H diag(s) / sqrt(n)
    m = sylvester64(n) @ torch.diag(signs.double()) / math.sqrt(n)
    ref = (x.double().reshape(4, 2, n) @ m).reshape(4, 2 * n)
    assert bool(((y.double() - ref).abs() <= tol(n) * block_norms(x, n, -1)).all())


def test_power_of_two_inputs_exact_for_n16():
    # n = 16: 1/sqrt(16) = 1/4 is exact and small integers sum exactly, so the result is exact
    x = torch.randint(-8, 9, (5, 32), generator=torch.Generator().manual_seed(0)).float()
    y = bs.hadamard(x, 16, signs=bs.TE_SIGNS_16)
    ref = reference(x, 16, bs.TE_SIGNS_16, -1)
    assert torch.equal(y.double(), ref)
    assert torch.equal(bs.inverse_hadamard(y, 16, signs=bs.TE_SIGNS_16), x)


# --------------------------------------------------------------------------------------------
# signs
# --------------------------------------------------------------------------------------------


def test_te_signs_match_spec():
    assert len(bs.TE_SIGNS_16) == 16
    assert [float(v) for v in bs.TE_SIGNS_16] == [float(v) for v in SPEC_TE_SIGNS]
    mask = sum(1 << i for i, v in enumerate(bs.TE_SIGNS_16) if v < 0)
    assert mask == 0xD7E8


@pytest.mark.parametrize("n", SIZES)
def test_random_signs(n):
    a = bs.random_signs(n, seed=42)
    b = bs.random_signs(n, seed=42)
    assert a.shape == (n,)
    assert a.dtype == torch.float32
    assert torch.equal(a, b)
    assert bool(((a == 1) | (a == -1)).all())
    others = [bs.random_signs(n, seed=s) for s in range(43, 48)]
    assert any(not torch.equal(a, o) for o in others)
    # both signs occur (probability of a constant vector is 2^(1-n))
    assert (a == 1).any() and (a == -1).any()


def test_random_signs_with_generator():
    a = bs.random_signs(32, generator=torch.Generator().manual_seed(1))
    b = bs.random_signs(32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    g = torch.Generator().manual_seed(1)
    c, d = bs.random_signs(32, generator=g), bs.random_signs(32, generator=g)
    assert not torch.equal(c, d)  # the generator advances (a redraw per call, as in Quartet II)


@pytest.mark.parametrize("signs", [list(SPEC_TE_SIGNS), tuple(SPEC_TE_SIGNS), torch.tensor(SPEC_TE_SIGNS),
                                   torch.tensor(SPEC_TE_SIGNS, dtype=torch.float64)])
def test_signs_accept_sequences_and_tensors(signs):
    x = _rand((2, 32), seed=4)
    assert torch.equal(bs.hadamard(x, 16, signs=signs), bs.hadamard(x, 16, signs=bs.TE_SIGNS_16))


# --------------------------------------------------------------------------------------------
# bad input and dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [24, 8, 256, 1, 0, 48])
@pytest.mark.parametrize("fn", [bs.hadamard, bs.inverse_hadamard])
def test_unsupported_n_raises(fn, n):
    x = torch.zeros(2, 768)
    with pytest.raises(ValueError, match=str(n)):
        fn(x, n)


@pytest.mark.parametrize("fn", [bs.hadamard, bs.inverse_hadamard])
def test_dim_not_multiple_of_n_raises(fn):
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 40), 16)
    with pytest.raises(ValueError):
        fn(torch.zeros(40, 32), 32, dim=0)
    with pytest.raises(ValueError):
        fn(torch.zeros(3, 16), 16, dim=0)


@pytest.mark.parametrize("fn", [bs.hadamard, bs.inverse_hadamard])
@pytest.mark.parametrize(
    "signs",
    [[1.0] * 15, [1.0] * 17, [1.0] * 32, [[1.0] * 16], [1.0] * 15 + [0.0], [1.0] * 15 + [2.0],
     [1.0] * 15 + [0.5], [1.0] * 15 + [-1.5], [1.0] * 15 + [float("nan")]],
    ids=["len15", "len17", "len32", "2d", "zero", "two", "half", "m1.5", "nan"],
)
def test_bad_signs_raise(fn, signs):
    with pytest.raises(ValueError):
        fn(torch.zeros(2, 16), 16, signs=signs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [bs.hadamard, bs.inverse_hadamard])
def test_low_precision_in_same_dtype_out(dtype, fn):
    x = _rand((4, 64), seed=6).to(dtype)
    signs = bs.random_signs(32, seed=1)
    y = fn(x, 32, signs=signs)
    assert y.dtype == dtype and y.shape == x.shape
    # computed in FP32, cast back once
    assert torch.equal(y, fn(x.float(), 32, signs=signs).to(dtype))


def test_bf16_roundtrip_close():
    x = _rand((4, 64), seed=6).to(torch.bfloat16)
    back = bs.inverse_hadamard(bs.hadamard(x, 32), 32)
    # two bf16 roundings (8 bits of mantissa) relative to the block norm
    nrm = block_norms(x.float(), 32, -1)
    assert bool(((back.double() - x.double()).abs() <= 2 * 2.0 ** -8 * nrm).all())


def test_hadamard_does_not_modify_input():
    x = _rand((2, 32), seed=0)
    x0 = x.clone()
    bs.hadamard(x, 32, signs=bs.random_signs(32, seed=0))
    bs.inverse_hadamard(x, 32, signs=bs.random_signs(32, seed=0))
    assert torch.equal(x, x0)


def test_hadamard_gemm_is_the_same_transform():
    from blockscale.quant.transforms.hadamard import hadamard_gemm, rht_matrix

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g)
    for n in (16, 32):
        signs = bs.random_signs(n, seed=1)
        ref = bs.hadamard(x, n=n, signs=signs)
        got = hadamard_gemm(x, n=n, signs=signs)
        assert torch.allclose(got, ref, rtol=0, atol=4e-6 * x.abs().max().item())
        m = rht_matrix(n, signs, dtype=torch.float64)
        assert torch.allclose(m @ m.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(rht_matrix(16, bs.TE_SIGNS_16) * 4, torch.tensor(bs.TE_SIGNS_16)[:, None] * bs.hadamard_matrix(16))
    with pytest.raises(ValueError, match="multiple of n=16"):
        hadamard_gemm(torch.zeros(3, 20))
