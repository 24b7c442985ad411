"""Checks of a checkpoint's sizes, values and digests, made before the model is built.

* config.json sizes against the safetensors headers (no tensor data read): ``vocab_size`` equals the
  embedding's rows, the decoder layer count equals the layer indices present in the tensor names.
* E4M3 block scales finite and non-negative: a byte b >= 0x7F is refused (0x7F and 0xFF are NaN,
  0x80..0xFE have the sign bit set, -0 included).
* Outer and input scales, S (compressed-tensors ``weight_global_scale`` / ``input_global_scale``) or
  1/S (ModelOpt ``weight_scale_2`` / ``input_scale``): positive, normal (>= 2**-126), finite FP32
  values whose FP32 reciprocal is finite.
* FP8 codes (FP8 and MXFP8 weights): no NaN byte (0x7F / 0xFF). FP8 scales (weight_scale, static
  input_scale) and KV-cache k_scale / v_scale: every element finite and > 0, and 448 x the largest
  weight scale finite. UE8M0 (MX) scale bytes != 255 (NaN), and the dequantized MX weight finite.
* Every other floating tensor (norms, embeddings, biases, high-precision Linears) finite.
* SHA-256 digests (our exports): each tensor's stored bytes and config.json's content.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError
from ..quant import MX, QuantizedTensor
from .files import Shards
from .schema import layer_count
from .writer import CONFIG_DIGEST_KEY, DIGEST_ALGO, DIGEST_KEY, DIGEST_MARKER, config_digest

FLT_TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal FP32
E4M3_FIRST_BAD = 0x7F
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
                      "tok_embeddings.weight")
EMBEDDING_WIDTH_KEYS = ("embedding_size", "word_embed_proj_dim", "embed_dim", "embedding_dim")
_SKIP = "load with verify=False (--no-verify) to use it anyway"
_HEX = re.compile(r"[0-9a-f]{64}")
_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _position(flat_index: int, shape) -> list[int]:
    pos = []
    for n in reversed(tuple(shape)):
        pos.append(flat_index % n)
        flat_index //= n
    return pos[::-1]


def _first(mask: torch.Tensor) -> int:
    return int(mask.reshape(-1).to(torch.uint8).argmax())


# ---- sizes ----------------------------------------------------------------------------------------
def check_sizes(cfg: dict, shards: Shards, config_path: Path) -> None:
    """config.json's vocabulary and layer count against the tensor names and header shapes."""
    emb = [k for k in shards.infos if k.endswith(EMBEDDING_SUFFIXES) and len(shards.infos[k].shape) == 2]
    if len(emb) == 1:
        t = shards.infos[emb[0]]
        sizes = [("vocab_size", 0)]
        if not any(k in cfg for k in EMBEDDING_WIDTH_KEYS):  # else the embedding width is not hidden_size
            sizes.append(("hidden_size", 1))
        for key, dim in sizes:
            v = cfg.get(key)
            if isinstance(v, int) and v != t.shape[dim]:
                raise CheckpointError(f"{config_path}: {key}={v} does not match the embedding {emb[0]!r} "
                                      f"{list(t.shape)} in {t.file}")
    layers = layer_count(cfg)
    if layers is None:
        return
    key, n = layers
    stacks: dict[str, set] = defaultdict(set)
    for name in shards.infos:
        m = _LAYER.match(name)
        if m:
            stacks[m.group(1)].add(int(m.group(2)))
    prefix, idx = max(stacks.items(), key=lambda kv: len(kv[1]), default=("layers", set()))
    found = max(idx) + 1 if idx else 0
    if found != n:
        held = f"{found} layer{'s' if found != 1 else ''}" + (f" ({prefix}.0 .. {prefix}.{found - 1})" if found else "")
        raise CheckpointError(f"{config_path}: {key}={n}, but the tensors in {shards.describe()} hold {held}")


def check_model_bytes(model_bytes: int, shards: Shards, config_path: Path) -> None:
    """The model config.json describes may not be far larger than the stored tensors (16x covers float64
    weights expanded from 4.5 bits; the slack covers buffers such as rotary tables)."""
    stored = sum(t.end - t.start for t in shards.infos.values())
    limit = 16 * stored + 256 * 2**20
    if model_bytes > limit:
        raise CheckpointError(f"{config_path}: the model it describes needs {model_bytes} bytes, more than 16x the "
                              f"{stored} bytes of stored tensors; its sizes do not match the checkpoint")


# ---- values ---------------------------------------------------------------------------------------
def check_block_scales(name: str, t: torch.Tensor, file: Path) -> None:
    """E4M3 block scales: every byte < 0x7F (finite and non-negative)."""
    u = t.view(torch.uint8)
    bad = u >= E4M3_FIRST_BAD
    n = int(bad.sum())
    if n:
        i = _first(bad)
        raise CheckpointError(f"{file}: tensor {name!r}: {n} of {u.numel()} E4M3 block-scale bytes are negative or NaN "
                              f"(first at {_position(i, u.shape)}, byte {int(u.reshape(-1)[i]):#04x}); block scales "
                              "must be finite and >= 0")


def check_outer_scale(name: str, t: torch.Tensor, file: Path) -> None:
    """A stored outer / input scale (S or 1/S): positive, normal, finite FP32 with a finite reciprocal."""
    v = t.to(torch.float32).reshape(-1)[:1]
    x = float(v[0]) if v.numel() else math.nan
    if not (math.isfinite(x) and x >= FLT_TINY and bool(torch.isfinite(1.0 / v).all())):
        raise CheckpointError(f"{file}: tensor {name!r}={x!r} must be a positive, normal (>= 2**-126), finite FP32 "
                              "value with a finite reciprocal")


def check_decode_range(name: str, stored: torch.Tensor, decode: torch.Tensor, scales: torch.Tensor,
                       file: Path) -> None:
    """The largest weight a module can hold, (6 x max block scale) x decode scale, must be finite FP32
    (``decode``: fl(1/S) from the stored outer scale ``stored``; ``scales``: the E4M3 block scales)."""
    smax = float(scales.float().max()) if scales.numel() else 0.0
    if not bool(torch.isfinite(torch.tensor(6.0 * smax, dtype=torch.float32) * decode.reshape(-1)[:1]).all()):
        raise CheckpointError(f"{file}: tensor {name!r}={float(stored.reshape(-1)[0])!r} dequantizes the largest code "
                              f"(6 x block scale {smax!r}) to inf; the outer scale is out of range")


def check_fp8_codes(name: str, t: torch.Tensor, file: Path) -> None:
    """E4M3 codes: no NaN byte (0x7F, 0xFF)."""
    u = t.view(torch.uint8)
    bad = (u == 0x7F) | (u == 0xFF)
    n = int(bad.sum())
    if n:
        i = _first(bad)
        raise CheckpointError(f"{file}: tensor {name!r}: {n} of {u.numel()} E4M3 codes are NaN (first at "
                              f"{_position(i, u.shape)}, byte {int(u.reshape(-1)[i]):#04x})")


def check_positive(name: str, t: torch.Tensor, file: Path) -> None:
    """FP32 (or 16-bit) scales: every element finite and > 0."""
    v = t.to(torch.float32)
    bad = ~(torch.isfinite(v) & (v > 0))
    n = int(bad.sum())
    if n or v.numel() == 0:
        i = _first(bad) if n else 0
        x = float(v.reshape(-1)[i]) if v.numel() else math.nan
        raise CheckpointError(f"{file}: tensor {name!r}: {n} of {v.numel()} scales are not finite and > 0 (first at "
                              f"{_position(i, v.shape)}: {x!r})")


def check_fp8_range(name: str, scale: torch.Tensor, file: Path) -> None:
    """448 x the largest FP8 weight scale must be finite FP32 (amax / 448 of finite weights is)."""
    smax = float(scale.to(torch.float32).max())
    if not math.isfinite(float(torch.tensor(448.0) * torch.tensor(smax, dtype=torch.float32))):
        raise CheckpointError(f"{file}: tensor {name!r}: scale {smax!r} dequantizes the largest E4M3 code (448) to "
                              "inf; the scale is out of range")


def check_ue8m0(name: str, t: torch.Tensor, file: Path) -> None:
    """UE8M0 scale bytes: 255 is NaN."""
    bad = t.view(torch.uint8) == 255
    n = int(bad.sum())
    if n:
        i = _first(bad)
        raise CheckpointError(f"{file}: tensor {name!r}: {n} of {t.numel()} UE8M0 scale bytes are 255 (NaN; first at "
                              f"{_position(i, t.shape)})")


def check_mx_finite(name: str, element: str, codes: torch.Tensor, scales: torch.Tensor, shape, file: Path) -> None:
    """The MX weight dequantized (v x 2**(b - 127)) must be finite."""
    w = QuantizedTensor(spec=MX(element), codes=codes, scales=scales, shape=torch.Size(shape),
                        dtype=torch.float32).dequantize(torch.float32)
    bad = ~torch.isfinite(w)
    n = int(bad.sum())
    if n:
        i = _first(bad)
        raise CheckpointError(f"{file}: tensor {name!r}: {n} weights dequantize to inf / NaN (first at "
                              f"{_position(i, w.shape)}); the UE8M0 scales are out of range")


def check_finite(name: str, t: torch.Tensor, file: Path) -> None:
    if not t.is_floating_point():
        return
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    if n:
        i = _first(bad)
        raise CheckpointError(f"{file}: tensor {name!r}: {n} non-finite value{'s' if n > 1 else ''} (first at "
                              f"{_position(i, t.shape)}: {float(t.reshape(-1)[i])!r}); stored weights must be finite")


# ---- digests --------------------------------------------------------------------------------------
def _digests(shards: Shards, fname: str, why: str) -> dict[str, str]:
    f = shards.root / fname
    meta = shards.metadata[fname]
    if DIGEST_KEY not in meta:
        raise CheckpointError(f"{f}: no SHA-256 digests (__metadata__[{DIGEST_KEY!r}]) although {why}: the digests "
                              f"were stripped or the file was replaced; {_SKIP}")
    try:
        d = json.loads(meta[DIGEST_KEY])
    except (ValueError, RecursionError):
        d = None
    if not (isinstance(d, dict) and all(isinstance(v, str) and _HEX.fullmatch(v) for v in d.values())):
        raise CheckpointError(f"{f}: __metadata__[{DIGEST_KEY!r}] is not a JSON object of SHA-256 hex digests")
    return d


def verify_digests(shards: Shards, cfg: dict, config_path: Path, marker: Optional[str]) -> None:
    """Check the SHA-256 of config.json and of every tensor against the shards' metadata. Nothing to
    check (another producer's checkpoint) when config.json has no marker and no shard has digests."""
    signed = [f for f in shards.files if DIGEST_KEY in shards.metadata[f] or CONFIG_DIGEST_KEY in shards.metadata[f]]
    if marker is None and not signed:
        return
    why = f"config.json records {DIGEST_MARKER}={DIGEST_ALGO!r}" if marker else "other shards of it carry digests"
    want_cfg = config_digest(cfg)
    recorded = {}
    for fname in shards.files:
        recorded[fname] = _digests(shards, fname, why)
        got = shards.metadata[fname].get(CONFIG_DIGEST_KEY)
        if got is None:
            raise CheckpointError(f"{shards.root / fname}: no config.json digest (__metadata__[{CONFIG_DIGEST_KEY!r}]) "
                                  f"although {why}; {_SKIP}")
        if got != want_cfg:
            raise CheckpointError(f"{config_path}: config.json does not match the SHA-256 digest recorded in {fname} "
                                  f"(it was modified after export); {_SKIP}")
    for name, t in sorted(shards.infos.items(), key=lambda kv: (kv[1].file, kv[1].start)):
        f = shards.root / t.file
        want = recorded[t.file].get(name)
        if want is None:
            raise CheckpointError(f"{f}: no SHA-256 digest for tensor {name!r} in __metadata__[{DIGEST_KEY!r}]; "
                                  f"{_SKIP}")
        if shards.sha256(name) != want:
            raise CheckpointError(f"{f}: tensor {name!r} does not match its recorded SHA-256 digest (the file is "
                                  f"corrupt or was modified after export); {_SKIP}")


__all__ = ["check_block_scales", "check_decode_range", "check_finite", "check_fp8_codes", "check_fp8_range",
           "check_model_bytes", "check_mx_finite", "check_outer_scale", "check_positive", "check_sizes", "check_ue8m0",
           "verify_digests"]
