"""Karpathy's llama2.c checkpoints ("legacy v0" .bin) and their SentencePiece-style BPE tokenizer.

Checkpoint file (all little-endian): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len; a negative vocab_size means the classifier is stored separately), then fp32
arrays in this order, each in nn.Linear [out, in] layout:

    tok_embeddings [vocab, dim]
    attention_norm [L, dim]    wq [L, dim, dim]    wk, wv [L, kv_dim, dim]    wo [L, dim, dim]
    ffn_norm [L, dim]          w1 [L, hidden, dim] w2 [L, dim, hidden]        w3 [L, hidden, dim]
    norm [dim]
    two RoPE tables [seq_len, head_dim/2] (cos, sin; recomputed by the model, so skipped)
    output [vocab, dim]        only when vocab_size < 0

Tokenizer file: int32 max_token_length, then for each token: float32 score, int32 length, bytes.

    model = load_stories260k(root / "stories260K/stories260K.bin")
    tok = load_tokenizer(root / "stories260K/tok512.bin")
    tok.decode(model.generate(torch.tensor([[tok.bos_id]]), 40)[0].tolist())  # "Once upon a time, ..."
    stream = torch.tensor(tok.encode(text, bos=True))  # a whole file as ONE stream (one dummy prefix)
    perplexity(model, stream, ctx_len=512).ppl          # 5.048 on tinystories_val_head.txt
"""
from __future__ import annotations

import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Union

import numpy as np
import torch

from .llama import Llama, LlamaConfig

PathLike = Union[str, Path]

_HEADER = struct.Struct("<7i")
_MAX_DIM = 1 << 20  # sanity bound on every header field: catches a text file or a wrong format


def load_stories260k(path: PathLike) -> Llama:
    """Read a llama2.c legacy-v0 checkpoint (e.g. stories260K.bin) into an fp32 ``Llama`` in eval mode.

    The file must have exactly the size its header implies; anything else raises ValueError naming
    the file and the problem.
    """
    path = Path(path)
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes is too short for the 28-byte llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = _HEADER.unpack_from(data, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  vocab_size=vocab, seq_len=seq_len)
    bad = [f"{k}={v}" for k, v in fields.items() if not 0 < v <= _MAX_DIM]
    if bad:
        raise ValueError(f"{path}: bad llama2.c header ({', '.join(bad)}): not a legacy v0 checkpoint?")
    if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise ValueError(f"{path}: bad llama2.c header: dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads} "
                         "need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim")
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    L = n_layers
    shapes = [
        ("tok_embeddings", (vocab, dim)),
        ("attention_norm", (L, dim)),
        ("wq", (L, dim, dim)),
        ("wk", (L, kv_dim, dim)),
        ("wv", (L, kv_dim, dim)),
        ("wo", (L, dim, dim)),
        ("ffn_norm", (L, dim)),
        ("w1", (L, hidden, dim)),
        ("w2", (L, dim, hidden)),
        ("w3", (L, hidden, dim)),
        ("norm", (dim,)),
        ("rope_tables", (2, seq_len, head_dim // 2)),
    ]
    if not shared:
        shapes.append(("output", (vocab, dim)))
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    expected = _HEADER.size + 4 * n_floats
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise ValueError(f"{path}: file {what}: {len(data)} bytes, but its header (dim={dim}, hidden={hidden}, "
                         f"layers={n_layers}, heads={n_heads}/{n_kv_heads}, vocab={vocab}, seq_len={seq_len}, "
                         f"{'shared' if shared else 'separate'} classifier) implies {expected}")

    flat = np.frombuffer(data, dtype="<f4", count=n_floats, offset=_HEADER.size)
    arrays, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = torch.from_numpy(flat[offset:offset + n].astype(np.float32).reshape(shape))
        offset += n
    for name, t in arrays.items():
        if name != "rope_tables" and not torch.isfinite(t).all():
            raise ValueError(f"{path}: array {name} contains NaN or inf")

    cfg = LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab,
                      hidden_dim=hidden, max_seq_len=seq_len, norm_eps=1e-5, rope_theta=10000.0,
                      rope_interleaved=True, tie_embeddings=shared)
    model = Llama(cfg, seed=0)
    sd = {"tok_embeddings.weight": arrays["tok_embeddings"], "norm.weight": arrays["norm"]}
    per_layer = {"attention_norm": "attention_norm", "ffn_norm": "ffn_norm",
                 "wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
                 "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3"}
    for i in range(n_layers):
        for src, dst in per_layer.items():
            sd[f"layers.{i}.{dst}.weight"] = arrays[src][i]
    sd["output.weight"] = arrays["tok_embeddings"] if shared else arrays["output"]
    model.load_state_dict(sd, strict=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# tokenizer

BOS_ID, EOS_ID = 1, 2
_BYTE0 = 3  # tokens 3..258 are the byte fallbacks <0x00>..<0xFF>


class Tok512:
    """SentencePiece-style BPE from a llama2.c tokenizer file (tok512.bin).

    encode: prepend one space to the text (SentencePiece's "dummy prefix"), map every character to
    its own token or, if it has none, to the byte-fallback tokens of its UTF-8 bytes; then merge, as
    long as possible, the adjacent pair whose concatenation is a token with the highest score
    (leftmost on ties). Byte-fallback tokens never merge.

    Speed: when no mergeable token contains a space except as its first character and none contains
    a newline (true of tok512), no merge can cross a space or a newline, so the text is cut before
    every space and around every newline and each piece is encoded once and cached. The result is
    exactly that of merging the whole text as one sequence.
    """

    def __init__(self, path: PathLike):
        path = Path(path)
        data = path.read_bytes()
        if len(data) < 4:
            raise ValueError(f"{path}: too short for a llama2.c tokenizer file")
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        pieces, scores, off = [], [], 4
        while off < len(data):
            if off + 8 > len(data):
                raise ValueError(f"{path}: truncated tokenizer record at byte {off}")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise ValueError(f"{path}: bad token length {n} at byte {off - 4}")
            pieces.append(data[off:off + n])
            scores.append(score)
            off += n
        if len(pieces) < _BYTE0 + 256:
            raise ValueError(f"{path}: {len(pieces)} tokens; expected special + 256 byte-fallback tokens first")
        for b in range(256):
            if pieces[_BYTE0 + b] != f"<0x{b:02X}>".encode():
                raise ValueError(f"{path}: token {_BYTE0 + b} is {pieces[_BYTE0 + b]!r}, expected <0x{b:02X}>")
        self.path = path
        self.pieces: list[bytes] = pieces
        self.scores: list[float] = scores
        self.vocab_size = len(pieces)
        self.bos_id, self.eos_id = BOS_ID, EOS_ID
        # only ordinary pieces take part in lookups and merges (not <unk>, <s>, </s>, <0xNN>)
        self._ids = {p: i for i, p in enumerate(pieces) if i >= _BYTE0 + 256}
        ordinary = [p for i, p in enumerate(pieces) if i >= _BYTE0 + 256]
        splittable = all(b" " not in p[1:] and b"\n" not in p for p in ordinary)
        self._split = re.compile(r"\n| [^ \n]*|[^ \n]+") if splittable else None
        self._encode_piece = lru_cache(maxsize=1 << 16)(self._merge)

    def _merge(self, text: str) -> tuple[int, ...]:
        ids: list[int] = []
        for ch in text:
            b = ch.encode("utf-8")
            i = self._ids.get(b)
            ids.extend([i] if i is not None else [_BYTE0 + c for c in b])
        # bytes of each symbol for merge lookups; byte-fallback symbols get None: they never merge
        syms = [self.pieces[i] if i >= _BYTE0 + 256 else None for i in ids]
        while len(ids) > 1:
            best, best_k, best_id = None, -1, -1
            for k in range(len(ids) - 1):
                if syms[k] is None or syms[k + 1] is None:
                    continue
                j = self._ids.get(syms[k] + syms[k + 1])
                if j is not None and (best is None or self.scores[j] > best):
                    best, best_k, best_id = self.scores[j], k, j
            if best is None:
                break
            ids[best_k:best_k + 2] = [best_id]
            syms[best_k:best_k + 2] = [self.pieces[best_id]]
        return tuple(ids)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of text (with the dummy-prefix space); BOS/EOS added if asked. encode("") = []."""
        ids = [self.bos_id] if bos else []
        if text:
            text = " " + text
            chunks: Iterable[str] = self._split.findall(text) if self._split is not None else [text]
            for chunk in chunks:
                ids.extend(self._encode_piece(chunk))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids: byte-fallback tokens become raw bytes, <unk>/<s>/</s> are dropped, and the
        dummy-prefix space of the first token is removed, so decode(encode(s)) == s."""
        out = bytearray()
        first = True
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
            if i < _BYTE0:
                continue
            piece = bytes([i - _BYTE0]) if i < _BYTE0 + 256 else self.pieces[i]
            if first and piece.startswith(b" "):
                piece = piece[1:]
            first = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: PathLike) -> Tok512:
    """Load a llama2.c tokenizer file (e.g. tok512.bin)."""
    return Tok512(path)


# ---- the same tokenizer as a transformers (``tokenizers``) one, saved next to exported checkpoints ----
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (tok512 spells BOS / EOS "\n<s>\n" / "\n</s>\n")


def _merges(tok: Tok512) -> list[tuple[str, str]]:
    """BPE merges equivalent to Tok512's rule: every split (a, b) of an ordinary token t = a + b into two
    ordinary tokens, ranked by t's score (highest first; tok512's scores are distinct)."""
    vocab = {p.decode("utf-8"): i for p, i in tok._ids.items()}
    out = []
    for t, i in vocab.items():
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                out.append((-tok.scores[i], k, (t[:k], t[k:])))
    return [m for _, _, m in sorted(out)]


def transformers_tokenizer(tok: Tok512):
    """A ``transformers.PreTrainedTokenizerFast`` giving Tok512's ids: a ``tokenizers`` BPE over the whole
    text (no pre-tokenizer) with byte fallback, the dummy-prefix space prepended by the normalizer, BOS 1 /
    EOS 2 / UNK 0 special (not split from text: ``split_special_tokens``), decoding byte-fallback tokens to
    bytes and dropping the first token's leading space. Ties between two different merges that make the
    same token at overlapping positions are broken by rank here and by position in Tok512 (no such pair
    exists in tok512: every token's splits into two ordinary tokens are ranked together)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": _BYTE0 + b for b in range(256)})
    vocab.update({p.decode("utf-8"): i for p, i in tok._ids.items()})
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=_merges(tok), unk_token="<unk>", byte_fallback=True,
                                  fuse_unk=False))
    raw.normalizer = normalizers.Prepend(" ")
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   add_bos_token=False, add_eos_token=False, split_special_tokens=True,
                                   clean_up_tokenization_spaces=False, model_max_length=512)
