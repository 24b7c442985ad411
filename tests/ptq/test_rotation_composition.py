"""Fused and online rotations composed (issue 33): with online Sylvester blocks in the plan, R1 / R2 use the random
Hadamard with its signs after H, so the composite rotation a residual-stream reader sees keeps spreading every
channel. With the signs first, ``diag(s) H_64 blockdiag(H_16) = 16 diag(s) (H_4 x I_16)``: the Sylvester factors
cancel, each input channel mixes with only 3 others (R1 + mr: 4 for NVFP4, 2 for MX; R1 + quip: none)."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale.ptq.rotations import parse_rotate, rotate_model
from blockscale.quant.transforms.rotation import rotation

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _support(m: torch.Tensor) -> int:
    """The fewest nonzero entries in a row of ``m``."""
    return int((m.abs() > 1e-6).sum(1).min())


@pytest.mark.parametrize("block", [16, 32])
def test_signs_first_cancel_against_sylvester_blocks(block):
    q1 = rotation("random-hadamard", 64, 0)
    blocks = torch.block_diag(*[rotation("hadamard", block).matrix()] * (64 // block))
    assert _support(q1.matrix() @ blocks) == 64 // block  # the cancellation (what R1 + mr computed before)
    t = q1.transposed()
    assert t.signs_after and not q1.signs_after and "signs after H" in t.describe()
    assert torch.equal(t.transposed().signed, q1.signed)
    assert torch.allclose(t.matrix() @ t.matrix().T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert _support(t.matrix() @ blocks) > block  # spreads over more than one quantization group


@pytest.mark.parametrize("rotate, block", [("r1r2+block:16", 16), ("r1r2+block:32", 32), ("r1r2+quip", 64)])
def test_r1_with_online_blocks_keeps_spreading(rotate, block):
    """The residual stream's composite rotation seen by q_proj (R1 from the embeddings, then the online blocks)."""
    model = tiny_hf_llama()
    emb = model.model.embed_tokens.weight.detach().double().clone()
    rep = rotate_model(model, parse_rotate(rotate), {})
    assert any("(signs after H)" in line for line in rep.lines())
    q1 = torch.linalg.lstsq(emb, model.model.embed_tokens.weight.detach().double()).solution  # E Q1 = E'
    online = model.model.layers[0].self_attn.q_proj.input_rotation
    assert online.size == block
    composite = q1 @ torch.block_diag(*[online.matrix()] * (64 // block))
    assert _support(composite) > min(block, 16)


def test_fused_only_plans_keep_their_rotation():
    """Without online input rotations R1 / R2 stay ``diag(s) H`` (the committed r1r2 / r1r2r4 results)."""
    a, b = tiny_hf_llama(), tiny_hf_llama()
    rotate_model(a, parse_rotate("r1r2r4"))
    q1 = rotation("random-hadamard", 64, 0)
    want = q1.fold_input(b.model.embed_tokens.weight.detach())
    assert torch.equal(a.model.embed_tokens.weight, want)
    assert not copy.deepcopy(q1).signs_after
