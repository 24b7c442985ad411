"""Loading untrusted NVFP4 checkpoints, that they are what was exported and only that: our exports
carry SHA-256 digests of every tensor and of config.json (verified unless ``verify=False``; other
producers' checkpoints have none and load without), and every file read resolves inside the checkpoint
directory (symlinks inside are followed, out of it refused). (Values and fields:
test_checkpoint_values.py.)"""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockscale.export import CheckpointError, export_checkpoint, load_checkpoint

from checkpoint_edits import (CT, MO, Q, SUFFIX, canonical_sha, copy, edit_config, exported, foreign,  # noqa: F401
                              offsets, qc, read_config, sha, shard_files, shard_metadata, sharded, write_config)
from nvfp4_checkpoints import make_model, model_logits  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


def test_exports_record_digests(tmp_path, exported):
    for fmt in (CT, MO):
        d = exported[fmt]
        cfg = read_config(d)
        assert cfg["quantization_config"]["blockscale"]["tensor_digests"] == "sha256"
        meta = shard_metadata(d / "model.safetensors")
        assert meta["blockscale.config_sha256"] == canonical_sha(cfg)
        digests = json.loads(meta["blockscale.sha256"])
        t = load_file(str(d / "model.safetensors"))
        assert digests == {k: sha(v) for k, v in t.items()}
    out = export_checkpoint(make_model(layers=1), tmp_path / "sh", CT, max_shard_size="8KB")
    files = shard_files(out)
    assert len(files) > 2
    for f in files:  # each shard lists exactly its own tensors
        assert set(json.loads(shard_metadata(f)["blockscale.sha256"])) == set(load_file(str(f)))
    assert torch.equal(model_logits(load_checkpoint(out)), model_logits(make_model(layers=1)))



# ---- 4. digests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [CT, MO])
def test_flipped_byte_in_codes_caught(tmp_path, exported, fmt):
    d = copy(exported[fmt], tmp_path / "ck")
    f = d / "model.safetensors"
    a, _ = offsets(f, Q + SUFFIX[fmt]["packed"])
    data = bytearray(f.read_bytes())
    data[a + 37] ^= 0x77
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{Q}{SUFFIX[fmt]['packed']}' does not "
                                              r"match its recorded SHA-256 digest.*verify=False"):
        load_checkpoint(d)
    wrong = load_checkpoint(d, verify=False)  # loads: the flip is a valid code, a different model
    assert not torch.equal(model_logits(wrong), exported["logits"])


def test_flipped_byte_in_a_later_shard_names_it(tmp_path, sharded):
    d = copy(sharded, tmp_path / "ck")
    f = shard_files(d)[-1]
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = min((k for k, v in header.items() if k != "__metadata__" and v["dtype"] != "F8_E4M3"),
               key=lambda k: header[k]["data_offsets"][0])
    data[8 + n + header[name]["data_offsets"][0]] ^= 0x01  # the lowest mantissa / code bit: still a valid value
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '{name}' does not match its recorded SHA-256 digest"):
        load_checkpoint(d)


def test_stripped_or_wrong_digests(tmp_path, exported):
    ref = exported["logits"]
    d = copy(exported[CT], tmp_path / "strip")
    f = d / "model.safetensors"
    save_file(load_file(str(f)), str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no SHA-256 digests .*tensor_digests='sha256'"):
        load_checkpoint(d)
    assert torch.equal(model_logits(load_checkpoint(d, verify=False)), ref)

    d = copy(exported[CT], tmp_path / "wrong")
    f = d / "model.safetensors"
    t, meta = load_file(str(f)), shard_metadata(f)
    digests = json.loads(meta["blockscale.sha256"])
    digests["model.norm.weight"] = "0" * 64
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": json.dumps(digests)})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' does not match its recorded SHA-256"):
        load_checkpoint(d)
    digests.pop("model.norm.weight")
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": json.dumps(digests)})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no SHA-256 digest for tensor 'model\.norm\.weight'"):
        load_checkpoint(d)
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": "[1, 2]"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: __metadata__\['blockscale\.sha256'\] is not a JSON "
                                              r"object of SHA-256 hex digests"):
        load_checkpoint(d)

    d = copy(exported[MO], tmp_path / "marker")  # digests kept, marker stripped from config.json
    edit_config(d, qc(lambda q: q["blockscale"].pop("tensor_digests")), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json does not match the SHA-256 digest recorded in "
                                              r"model\.safetensors"):
        load_checkpoint(d)
    assert torch.equal(model_logits(load_checkpoint(d, verify=False)), ref)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_modified_config_caught(tmp_path, exported, fmt):
    d = copy(exported[fmt], tmp_path / "ck")
    edit_config(d, lambda c: c.__setitem__("rms_norm_eps", 1e-5), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json does not match the SHA-256 digest recorded in "
                                              r"model\.safetensors \(it was modified after export\).*verify=False"):
        load_checkpoint(d)
    assert not torch.equal(model_logits(load_checkpoint(d, verify=False)), exported["logits"])
    d = copy(exported[fmt], tmp_path / "reindented")  # whitespace is not content
    write_config(d, read_config(d))
    assert torch.equal(model_logits(load_checkpoint(d)), exported["logits"])


@pytest.mark.parametrize("fmt", [CT, MO])
def test_foreign_checkpoint_loads_without_digests(tmp_path, exported, fmt):
    d = foreign(copy(exported[fmt], tmp_path / "ck"))
    assert torch.equal(model_logits(load_checkpoint(d)), exported["logits"])


def test_open_model_passes_verify(tmp_path, exported):
    from blockscale.ptq.pipeline import open_model

    d = copy(exported[CT], tmp_path / "ck")
    f = d / "model.safetensors"
    a, _ = offsets(f, Q + "weight_packed")
    data = bytearray(f.read_bytes())
    data[a] ^= 0x11
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        open_model(str(d))
    assert open_model(str(d), verify=False).model is not None


# ---- 5. paths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json", "generation_config.json",
                                  "tokenizer.json"])
def test_symlink_outside_refused(tmp_path, exported, name):
    d = copy(exported[MO], tmp_path / "ck")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / name
    if (d / name).exists():
        shutil.move(str(d / name), str(target))
    else:
        target.write_text("{}")
    os.symlink(target, d / name)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d / name))}: a symlink to {re.escape(str(target.resolve()))}, "
                                              r"outside the checkpoint directory"):
        load_checkpoint(d)


def test_symlinks_inside_are_followed(tmp_path, exported):
    d = copy(exported[CT], tmp_path / "ck")
    (d / "blobs").mkdir()
    shutil.move(str(d / "model.safetensors"), str(d / "blobs" / "x"))
    os.symlink(d / "blobs" / "x", d / "model.safetensors")
    os.symlink("blobs", d / "alias")  # a directory link inside
    assert torch.equal(model_logits(load_checkpoint(d)), exported["logits"])
    os.symlink(tmp_path, d / "blobs" / "up")  # not top level, never read: allowed
    assert torch.equal(model_logits(load_checkpoint(d)), exported["logits"])
    os.symlink(tmp_path / "nowhere", d / "dangling.json")
    with pytest.raises(CheckpointError, match=r"dangling\.json: a symlink to .*nowhere, outside the checkpoint"):
        load_checkpoint(d)


def test_sharded_symlinks(tmp_path, sharded):
    d = copy(sharded, tmp_path / "ck")
    shard = shard_files(d)[1]
    shutil.move(str(shard), str(tmp_path / shard.name))
    os.symlink(tmp_path / shard.name, shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: a symlink to .*outside the checkpoint directory"):
        load_checkpoint(d)
