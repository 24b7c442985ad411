"""The Llama model: shapes, GQA, tying, causality, loss, generation, RoPE, a short training run."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from blockscale.models import PRESETS, Llama, LlamaConfig, apply_rope, rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = PRESETS["tiny"]


def _tokens(B, T, vocab=TINY.vocab_size, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_presets():
    model = Llama(TINY, seed=0)
    logits = model(_tokens(2, 16))
    assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == torch.float32
    assert model.num_params() < 100_000
    assert 3_000_000 <= Llama(PRESETS["small"], seed=0).num_params() <= 6_000_000
    assert Llama(PRESETS["stories260k"], seed=0).num_params() == 260_032
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, TINY.max_seq_len + 1))


def test_config_defaults_and_validation():
    assert LlamaConfig(dim=64, multiple_of=4).hidden_dim == 172  # Llama's 2/3 * 4d rule (stories260K)
    assert LlamaConfig(dim=64, n_heads=8).n_kv_heads == 8
    for bad in (dict(dim=60, n_heads=8), dict(n_heads=8, n_kv_heads=3), dict(dim=24, n_heads=8), dict(n_layers=0)):
        with pytest.raises(ValueError):
            LlamaConfig(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.dim = 64


def test_linear_module_names_are_stable():
    model = Llama(TINY, seed=0)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {"output"}
    for i in range(TINY.n_layers):
        expected |= {f"layers.{i}.attention.{w}" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert linears == expected
    assert all(model.get_submodule(n).bias is None for n in linears)
    assert isinstance(model.layers, nn.ModuleList)
    assert set(model.state_dict()) >= {f"{n}.weight" for n in linears} | {"tok_embeddings.weight", "norm.weight"}


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Query head h reads kv head h // (n_heads / n_kv_heads): duplicating each kv head's rows gives MHA."""
    gqa = Llama(TINY, seed=1)
    assert TINY.n_kv_heads < TINY.n_heads
    assert gqa.layers[0].attention.wk.weight.shape == (TINY.n_kv_heads * TINY.head_dim, TINY.dim)
    mha = Llama(dataclasses.replace(TINY, n_kv_heads=TINY.n_heads), seed=1)
    sd = gqa.state_dict()
    rep, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    for key in list(sd):
        if key.endswith(("wk.weight", "wv.weight")):
            sd[key] = sd[key].view(TINY.n_kv_heads, hd, TINY.dim).repeat_interleave(rep, 0).reshape(-1, TINY.dim)
    mha.load_state_dict(sd)
    x = _tokens(2, 20)
    torch.testing.assert_close(mha(x), gqa(x), rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_storage():
    tied = Llama(TINY, seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    untied = Llama(dataclasses.replace(TINY, tie_embeddings=False), seed=0)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == TINY.vocab_size * TINY.dim
    with torch.no_grad():
        tied.tok_embeddings.weight[3].add_(1.0)
    assert torch.equal(tied.output.weight[3], tied.tok_embeddings.weight[3])


def test_causal():
    model = Llama(TINY, seed=0)
    x = _tokens(1, 24)
    y = x.clone()
    y[0, 15] = (y[0, 15] + 1) % TINY.vocab_size
    lx, ly = model(x), model(y)
    assert torch.equal(lx[:, :15], ly[:, :15])
    assert not torch.allclose(lx[:, 15:], ly[:, 15:])


def test_loss_equals_manual_cross_entropy():
    model = Llama(TINY, seed=0)
    x, t = _tokens(3, 12, seed=1), _tokens(3, 12, seed=2)
    t[0, :4] = -1  # ignored positions
    logits, loss = model(x, t)
    logp = F.log_softmax(logits.double(), dim=-1)
    keep = t != -1
    manual = -logp[keep].gather(-1, t[keep][:, None]).mean()
    assert abs(loss.item() - manual.item()) < 1e-5


def test_generate_is_deterministic_greedy():
    model = Llama(TINY, seed=0)
    start = _tokens(2, 3)
    a = model.generate(start, 10)
    assert a.shape == (2, 13) and torch.equal(a[:, :3], start)
    assert torch.equal(a, model.generate(start, 10))
    # each new token is the argmax of the logits of the sequence so far
    for t in range(3, 13):
        assert torch.equal(a[:, t], model(a[:, :t])[:, -1].argmax(-1))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(model.generate(start, 8, temperature=1.0, generator=g1),
                       model.generate(start, 8, temperature=1.0, generator=g2))


def test_init_weights_seeded():
    a, b, c = Llama(TINY, seed=3), Llama(TINY, seed=3), Llama(TINY, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)
    std = a.layers[0].attention.wq.weight.std().item()
    std_res = torch.cat([a.layers[i].attention.wo.weight.flatten() for i in range(TINY.n_layers)]).std().item()
    assert 0.015 < std < 0.025 and std_res < 0.7 * std  # residual projections are scaled down


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_is_a_rotation(interleaved):
    head_dim, T = 16, 40
    cos, sin = rope_tables(head_dim, T, 10000.0)
    q, k = torch.randn(2, 3, T, head_dim), torch.randn(2, 3, T, head_dim)
    rq = apply_rope(q, cos, sin, interleaved)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # norm preserving
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])      # position 0: angle 0
    # relative: <R_m q, R_n k> depends only on m - n (same vectors placed at shifted positions)
    qs, ks = q[..., :1, :].expand(-1, -1, T, -1), k[..., :1, :].expand(-1, -1, T, -1)
    rqs, rks = apply_rope(qs, cos, sin, interleaved), apply_rope(ks, cos, sin, interleaved)
    d1 = (rqs[..., 7, :] * rks[..., 3, :]).sum(-1)
    d2 = (rqs[..., 30, :] * rks[..., 26, :]).sum(-1)
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-4)


def test_rope_styles_differ_by_a_permutation():
    """Interleaved pairs (2i, 2i+1) = half-split pairs (i, i+d/2) after permuting each head's wq/wk rows."""
    head_dim = TINY.head_dim
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    cos, sin = rope_tables(head_dim, 10, 10000.0)
    x = torch.randn(1, 2, 10, head_dim)
    torch.testing.assert_close(apply_rope(x, cos, sin, True)[..., perm], apply_rope(x[..., perm], cos, sin, False))

    inter = Llama(TINY, seed=2)
    half = Llama(dataclasses.replace(TINY, rope_interleaved=False), seed=2)
    sd = inter.state_dict()
    for key in list(sd):
        if key.endswith(("wq.weight", "wk.weight")):
            w = sd[key].view(-1, head_dim, TINY.dim)
            sd[key] = w[:, perm].reshape(-1, TINY.dim)
    half.load_state_dict(sd)
    x = _tokens(2, 20)
    torch.testing.assert_close(half(x), inter(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(Llama(dataclasses.replace(TINY, rope_interleaved=False), seed=2)(x), inter(x))


def test_tiny_llama_trains():
    torch.manual_seed(0)
    model = Llama(TINY, seed=0)
    period = torch.randint(0, TINY.vocab_size, (17,), generator=torch.Generator().manual_seed(0))
    seq = period.repeat(4)[:TINY.max_seq_len + 1]
    x, y = seq[:-1].repeat(4, 1), seq[1:].repeat(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(256) at init
    assert losses[-1] < losses[0] / 20
