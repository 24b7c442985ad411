"""stories260K (Karpathy's llama2.c) on real data: loader, tokenizer, greedy sample, perplexity.

The known numbers come from ../shared/data/README.md (measured there with an independent loader).
"""
import dataclasses
import math
import struct

import pytest
import torch

from blockscale.data import Tokenizer
from blockscale.data.paths import data_root
from blockscale.eval import PerplexityResult, perplexity
from blockscale.models import PRESETS, Llama, Tok512, load_stories260k, load_tokenizer

CKPT = data_root() / "stories260K" / "stories260K.bin"
TOK = data_root() / "stories260K" / "tok512.bin"
TEXT = data_root() / "tinystories" / "tinystories_val_head.txt"

needs_data = pytest.mark.skipif(not (CKPT.is_file() and TOK.is_file() and TEXT.is_file()),
                                reason=f"stories260K / TinyStories data not found under {data_root()} "
                                       "(set BLOCKSCALE_DATA to the shared data folder)")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # the test machine is shared: one thread is faster than two fighting over busy cores
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return load_stories260k(CKPT)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOK)


@pytest.fixture(scope="module")
def text():
    return TEXT.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# loader

@needs_data
def test_loads_stories260k(model):
    cfg = model.config
    assert model.num_params() == 260_032
    assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == \
           (64, 172, 5, 8, 4, 512, 512)
    assert cfg.rope_interleaved and cfg.tie_embeddings and not model.training
    assert model.output.weight is model.tok_embeddings.weight
    assert dataclasses.replace(cfg, multiple_of=4) == PRESETS["stories260k"]
    # the first weight after the header is the first embedding value
    first = struct.unpack_from("<f", CKPT.read_bytes(), 28)[0]
    assert model.tok_embeddings.weight[0, 0].item() == first


@needs_data
def test_greedy_sample_matches_known_text(model, tok):
    out = model.generate(torch.tensor([[tok.bos_id]]), max_new_tokens=48)
    sample = tok.decode(out[0].tolist())
    assert sample.startswith("Once upon a time, there was a little girl named Lily. "
                             "She loved to play outside in the park. One day, she saw a big, red ball."), sample


def _write_legacy_v0(model: Llama, path, shared=True):
    """Write ``model`` in llama2.c's legacy v0 layout (an independent writer for the loader's tests)."""
    c = model.config
    L = model.layers
    vocab = c.vocab_size if shared else -c.vocab_size
    parts = [model.tok_embeddings.weight]
    parts += [torch.stack([getattr(b, "attention_norm").weight for b in L])]
    parts += [torch.stack([getattr(b.attention, w).weight for b in L]) for w in ("wq", "wk", "wv", "wo")]
    parts += [torch.stack([b.ffn_norm.weight for b in L])]
    parts += [torch.stack([getattr(b.feed_forward, w).weight for b in L]) for w in ("w1", "w2", "w3")]
    parts += [model.norm.weight, torch.zeros(2, c.max_seq_len, c.head_dim // 2)]
    if not shared:
        parts.append(model.output.weight)
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, vocab, c.max_seq_len))
        for p in parts:
            f.write(p.detach().numpy().astype("<f4").tobytes())


@pytest.mark.parametrize("shared", [True, False])
def test_loader_round_trip(tmp_path, shared):
    src = Llama(dataclasses.replace(PRESETS["tiny"], tie_embeddings=shared), seed=7)
    _write_legacy_v0(src, tmp_path / "m.bin", shared=shared)
    got = load_stories260k(tmp_path / "m.bin")
    assert got.config.tie_embeddings == shared
    assert (got.output.weight is got.tok_embeddings.weight) == shared
    for (n, p), (m, q) in zip(src.state_dict().items(), got.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    x = torch.randint(0, 256, (1, 10))
    assert torch.equal(src(x), got(x))


@needs_data
def test_corrupt_checkpoints_raise(tmp_path):
    data = CKPT.read_bytes()

    def check(name, blob, match):
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(ValueError, match=match) as e:
            load_stories260k(p)
        assert name in str(e.value)

    check("truncated.bin", data[:-100], "truncated")
    check("trailing.bin", data + b"\0" * 4, "trailing")
    check("short.bin", data[:20], "too short")
    check("empty.bin", b"", "too short")
    check("zero_dim.bin", struct.pack("<7i", 0, 172, 5, 8, 4, 512, 512) + data[28:], "dim=0")
    check("huge.bin", struct.pack("<7i", 64, 172, 5, 8, 4, 1 << 30, 512) + data[28:], "vocab_size")
    check("heads.bin", struct.pack("<7i", 64, 172, 5, 8, 3, 512, 512) + data[28:], "n_kv_heads")
    check("text.bin", b"this is not a checkpoint, just some text" * 10, "header|bytes")
    nan = bytearray(data)
    struct.pack_into("<f", nan, 28 + 4 * 1000, float("nan"))
    check("nan.bin", bytes(nan), "NaN")


# ---------------------------------------------------------------------------------------------
# tokenizer

@needs_data
@pytest.mark.parametrize("s", ["Once upon a time, there was a little girl named Lily.",
                               "  leading spaces,\ttabs\nand\n\nnewlines \n",
                               "Café ñoño – “quotes” … naïve",       # characters that have tokens
                               "日本語 🙂 Ωμέγα \x00\x7f",             # byte fallback
                               "", " ", "\n", "a"])
def test_tokenizer_round_trip(tok, s):
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode(s, bos=True, eos=True)) == s


@needs_data
def test_tokenizer_details(tok):
    assert isinstance(tok, Tok512) and len(tok) == tok.vocab_size == 512 and (tok.bos_id, tok.eos_id) == (1, 2)
    assert isinstance(tok, Tokenizer)  # the one tokenizer interface
    assert tok.encode("") == [] and tok.encode("", bos=True, eos=True) == [1, 2]
    ids = tok.encode("Lily")
    assert tok.encode("Lily", bos=True, eos=True) == [1] + ids + [2]
    assert tok.pieces[ids[0]].startswith(b" ")  # the dummy-prefix space
    ids = tok.encode("a 日")  # not in the vocabulary: its three UTF-8 bytes as tokens 3 + byte
    assert ids[-3:] == [3 + b for b in "日".encode()]
    assert tok.encode("the the") == [tok._ids[b" the"]] * 2  # merged to a single token each


@needs_data
def test_tokenizer_chunked_encode_equals_whole_text_merge(tok, text):
    """The cached per-word path must equal merging the whole text as one sequence."""
    sample = text[:3000]
    assert tok.encode(sample) == list(tok._merge(" " + sample))


# ---------------------------------------------------------------------------------------------
# perplexity

@needs_data
def test_perplexity_one_stream(model, tok, text):
    """README: one stream, a single BOS at its start, 512-token windows: 1.619 nats/token, ppl 5.05."""
    stream = torch.tensor(tok.encode(text, bos=True))
    r = perplexity(model, stream, ctx_len=512)
    n_win = math.ceil(len(stream) / 512)
    assert r.tokens_evaluated == len(stream) - n_win
    assert abs(r.loss - 1.619) < 0.001 and abs(r.ppl - 5.05) < 0.02, r


@needs_data
def test_perplexity_bos_per_window(model, tok, text):
    """README: BOS prepended to every window instead: ppl 5.32."""
    stream = torch.tensor(tok.encode(text))
    r = perplexity(model, stream, ctx_len=512, bos_id=tok.bos_id)
    assert r.tokens_evaluated == len(stream)
    assert abs(r.ppl - 5.32) < 0.03, r


class _Uniform(torch.nn.Module):
    """Equal logits everywhere: loss = ln(vocab) for every token. Records what it was given."""

    def __init__(self, vocab, hf=False):
        super().__init__()
        self.vocab, self.hf, self.seen = vocab, hf, []
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        self.seen.append(idx.clone())
        logits = torch.zeros(*idx.shape, self.vocab)
        return type("Out", (), {"logits": logits})() if self.hf else logits


@pytest.mark.parametrize("hf", [False, True])
def test_perplexity_windows(hf):
    toks = torch.arange(23) % 7
    m = _Uniform(10, hf=hf).train()
    r = perplexity(m, toks, ctx_len=5, batch_size=2)
    assert isinstance(r, PerplexityResult) and m.training  # training flag restored
    assert r.tokens_evaluated == 4 * 4 + 2  # windows of 5 (4 scored) and the last of 3 (2 scored)
    assert math.isclose(r.loss, math.log(10), rel_tol=1e-6) and math.isclose(r.ppl, 10.0, rel_tol=1e-6)
    assert [s.shape for s in m.seen] == [(2, 4), (2, 4), (1, 2)]
    assert torch.equal(m.seen[0][1], toks[5:9])

    m.seen.clear()
    r = perplexity(m, toks, ctx_len=5, bos_id=9, batch_size=8)
    assert r.tokens_evaluated == 23  # every token scored once
    assert [s.shape for s in m.seen] == [(5, 4), (1, 3)]
    assert torch.equal(m.seen[0][1], torch.cat((torch.tensor([9]), toks[4:7])))


def test_perplexity_bad_input():
    m = _Uniform(10)
    with pytest.raises(ValueError):
        perplexity(m, torch.zeros(2, 3, dtype=torch.long), ctx_len=4)
    with pytest.raises(ValueError):
        perplexity(m, torch.zeros(8), ctx_len=4)
    with pytest.raises(ValueError):
        perplexity(m, torch.zeros(8, dtype=torch.long), ctx_len=1)
    with pytest.raises(ValueError):
        perplexity(m, torch.zeros(1, dtype=torch.long), ctx_len=4)
