"""Rotations as data (blockscale.quant.transforms.rotation): Hadamard orthogonality, seeded signs, the block-
diagonal products each place uses against explicit matrices, stored matrices validated, and the online input
rotation of a module (blockscale.nn.input_rotation) against the explicit product."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from blockscale.nn.input_rotation import attach_input_rotation, carry_input_rotation, input_rotation
from blockscale.quant.transforms.rotation import (ROTATION_KINDS, largest_power_of_two_divisor, rotation,
                                                  stored_rotation)


def _blockdiag(rot, dim):
    return torch.block_diag(*[rot.matrix()] * (dim // rot.size))


@pytest.mark.parametrize("n", [1, 2, 16, 64, 512])
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_hadamard_rows_orthogonal_exactly(kind, n):
    r = rotation(kind, n, seed=3)
    s = r.signed
    assert bool(((s == 1) | (s == -1)).all())
    assert torch.equal(s @ s.T, n * torch.eye(n, dtype=torch.float64))  # exact in FP64 (integers)
    m = r.matrix()
    assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-14, rtol=0)
    if kind == "hadamard":
        assert torch.equal(s, s.T)  # Sylvester is symmetric


def test_sylvester_recursion():
    h4 = rotation("hadamard", 4).signed
    h8 = rotation("hadamard", 8).signed
    assert torch.equal(h8, torch.cat((torch.cat((h4, h4), 1), torch.cat((h4, -h4), 1)), 0))


def test_random_signs_reproducible_and_seeded():
    a, b, c = (rotation("random-hadamard", 64, seed=s).signed for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    h = rotation("hadamard", 64).signed
    signs = a[:, 0] / h[:, 0]
    assert torch.equal(a, signs[:, None] * h)  # diag(s) . H


def test_identity_rotation_is_exact():
    r = rotation("identity", 16)
    x = torch.randn(3, 64)
    assert torch.equal(r.apply(x), x)
    w = torch.randn(8, 64)
    assert torch.equal(r.fold_input(w), w)
    w_out = torch.randn(32, 5)
    assert torch.equal(r.fold_output(w_out), w_out)


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_places_equal_explicit_products(kind):
    r = rotation(kind, 16, seed=1)
    q = _blockdiag(r, 64)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    assert torch.allclose(r.apply(x), x @ q, atol=1e-12, rtol=0)
    w = torch.randn(24, 64, dtype=torch.float64)
    assert torch.allclose(r.fold_input(w), w @ q, atol=1e-12, rtol=0)
    w_out = torch.randn(64, 24, dtype=torch.float64)
    assert torch.allclose(r.fold_output(w_out), q.T @ w_out, atol=1e-12, rtol=0)
    # the pairings: (x Q)(W Q)^T == x W^T; a Linear with Q^T W outputs y Q
    assert torch.allclose(r.apply(x) @ r.fold_input(w).T, x @ w.T, atol=1e-10, rtol=0)
    w2 = torch.randn(64, 24, dtype=torch.float64)  # [N=64, K=24]
    x2 = torch.randn(5, 24, dtype=torch.float64)
    assert torch.allclose(x2 @ r.fold_output(w2).T, (x2 @ w2.T) @ q, atol=1e-10, rtol=0)


def test_fp32_apply_is_one_gemm_per_block_row():
    r = rotation("hadamard", 32)
    x = torch.randn(4, 96)
    want = (x.reshape(-1, 32) @ r.matrix(torch.float32)).reshape(4, 96)
    assert torch.equal(r.apply(x), want)
    assert r.apply(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [(("nope", 16), "allowed: hadamard"), (("hadamard", 12), "power of two"),
                                        (("hadamard", 1 << 16), "power of two"), (("hadamard", True), "power of two")])
def test_rotation_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        rotation(*bad)
    assert ROTATION_KINDS == ("hadamard", "random-hadamard", "identity")


def test_stored_rotation_validation():
    h = rotation("random-hadamard", 16, seed=2).signed
    r = stored_rotation("random-hadamard", h.to(torch.bfloat16))
    assert torch.equal(r.signed, h) and r.size == 16
    assert stored_rotation("hadamard", rotation("hadamard", 8).signed.float()).kind == "hadamard"
    with pytest.raises(ValueError, match="exactly \\+1 or -1"):
        stored_rotation("hadamard", rotation("hadamard", 8).signed / math.sqrt(8))  # normalised: refused
    bad = h.clone()
    bad[0, 0] = -bad[0, 0]
    with pytest.raises(ValueError, match="not orthogonal"):
        stored_rotation("random-hadamard", bad)
    with pytest.raises(ValueError, match="Sylvester"):
        stored_rotation("hadamard", h)
    with pytest.raises(ValueError, match="square"):
        stored_rotation("hadamard", torch.ones(4, 8))
    with pytest.raises(ValueError, match="transform type"):
        stored_rotation("random-matrix", h)


def test_block_checks_and_sizes():
    r = rotation("hadamard", 16)
    with pytest.raises(ValueError, match="not a multiple"):
        r.apply(torch.randn(2, 24))
    assert [largest_power_of_two_divisor(n) for n in (576, 1536, 688, 64, 896, 4864)] == [64, 512, 16, 64, 128, 256]


def test_online_input_rotation_on_a_module():
    torch.manual_seed(0)
    lin = nn.Linear(64, 8)
    r = rotation("hadamard", 32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        plain = lin(x)
        lin.weight.copy_(r.fold_input(lin.weight))
    attach_input_rotation(lin, r, "v")
    seen = []
    lin.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    with torch.no_grad():
        out = lin(x)
    assert torch.equal(seen[0], r.apply(x))  # forward hooks (PTQ statistics) see the rotated input
    assert torch.allclose(out, plain, atol=1e-5, rtol=0)
    explicit = nn.functional.linear(x.double() @ _blockdiag(r, 64), lin.weight.double(), lin.bias.double())
    assert torch.allclose(out.double(), explicit, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="already has"):
        attach_input_rotation(lin, r, "v")
    other = nn.Linear(64, 8)
    carry_input_rotation(lin, other)
    assert input_rotation(other) is r and other.input_rotation_group == "v"
    with pytest.raises(ValueError, match="not a multiple"):
        attach_input_rotation(nn.Linear(48, 4), r, "v")
