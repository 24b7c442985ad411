"""Edits of exported checkpoints for the validation tests (test_checkpoint_values.py,
test_checkpoint_integrity.py, test_checkpoint_fuzz.py): copy, re-sign (``seal``) or strip the digests
(``foreign``), edit tensors or configs, and the module-scoped exports they start from."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockscale.export import export_checkpoint

from nvfp4_checkpoints import CT, MO, make_model, model_logits  # noqa: E402

Q = "model.layers.0.self_attn.o_proj."  # a Linear outside any fused group (its own outer scale)
SUFFIX = {CT: {"packed": "weight_packed", "outer": "weight_global_scale", "input": "input_global_scale"},
          MO: {"packed": "weight", "outer": "weight_scale_2", "input": "input_scale"}}


# ---- edits ----------------------------------------------------------------------------------------
def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def canonical_sha(cfg: dict) -> str:
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def shard_metadata(f: Path) -> dict:
    with safe_open(str(f), "pt") as h:
        return h.metadata() or {}


def read_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg, indent=2, allow_nan=True))


def seal(d: Path) -> Path:
    """Re-sign ``d`` as our exporter would (digests of the current tensors and config.json): what a
    consistent but hostile checkpoint looks like, so only value validation can refuse it."""
    cfg_sha = canonical_sha(read_config(d))
    for f in shard_files(d):
        t = load_file(str(f))
        meta = {"format": "pt", "blockscale.config_sha256": cfg_sha,
                "blockscale.sha256": json.dumps({k: sha(v) for k, v in t.items()})}
        save_file(t, str(f), metadata=meta)
    return d


def foreign(d: Path) -> Path:
    """``d`` as another producer would write it: no digest marker, no digests."""
    cfg = read_config(d)
    cfg["quantization_config"]["blockscale"].pop("tensor_digests")
    write_config(d, cfg)
    for f in shard_files(d):
        save_file(load_file(str(f)), str(f), metadata={"format": "pt"})
    return d


def edit_tensors(d: Path, fn, *, sealed=True) -> Path:
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})
    return seal(d) if sealed else d


def edit_config(d: Path, fn, *, sealed=True, file="config.json") -> Path:
    cfg = json.loads((d / file).read_text())
    fn(cfg)
    (d / file).write_text(json.dumps(cfg, indent=2, allow_nan=True))
    return seal(d) if sealed else d


def offsets(f: Path, name: str) -> tuple[int, int]:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    a, b = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def set_byte(t: torch.Tensor, pos, value: int) -> None:
    u = t.view(torch.uint8)
    u[pos] = value


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    model = make_model(layers=1, act="6", bias=True)
    out = {fmt: export_checkpoint(model, root / fmt, fmt) for fmt in (CT, MO)}
    out["logits"] = model_logits(model)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return export_checkpoint(make_model(layers=1), tmp_path_factory.mktemp("sharded") / "ck", CT,
                             max_shard_size="8KB")


def qc(fn):
    """An edit of config.json's quantization_config."""
    return lambda c: fn(c["quantization_config"])


__all__ = ["CT", "MO", "Q", "SUFFIX", "canonical_sha", "copy", "edit_config", "edit_tensors", "exported", "foreign",
           "offsets", "qc", "read_config", "seal", "set_byte", "sha", "shard_files", "shard_metadata", "sharded",
           "write_config"]
