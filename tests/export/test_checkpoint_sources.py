"""Checkpoint directories as they reach users: a Hugging Face hub cache snapshot (files are symlinks into
the repository's blobs/) loads; a symlink out of it anywhere else is refused; the detection helpers that
run before ``blockscale.load`` (models.hf.is_blockscale_checkpoint / source_model) never raise on a
hostile config.json and never follow a symlink out of the directory."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from blockscale.export import CheckpointError, export_checkpoint, load_checkpoint
from blockscale.models.hf import is_blockscale_checkpoint, source_model

from nvfp4_checkpoints import CT, MO, make_model, model_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    model = make_model(layers=1)
    return {fmt: export_checkpoint(model, root / fmt, fmt, metadata={"model": "org/name"}) for fmt in (CT, MO)}, \
        model_logits(model)


def _hub_snapshot(src: Path, cache: Path, repo="models--org--name") -> Path:
    """The hub cache layout: blobs/<hash> files, snapshots/<rev>/<name> -> ../../blobs/<hash>."""
    blobs, snap = cache / repo / "blobs", cache / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        shutil.copy(f, blobs / f"blob-{f.name}")
        os.symlink(Path("..") / ".." / "blobs" / f"blob-{f.name}", snap / f.name)
    return snap


@pytest.mark.parametrize("fmt", [CT, MO])
def test_hub_cache_snapshot_loads(tmp_path, exported, fmt):
    dirs, logits = exported
    snap = _hub_snapshot(dirs[fmt], tmp_path / "hub")
    assert all((snap / n).is_symlink() for n in os.listdir(snap))
    assert torch.equal(model_logits(load_checkpoint(snap)), logits)
    assert is_blockscale_checkpoint(snap) and source_model(snap) == "org/name"


@pytest.mark.parametrize("layout", ["not-a-snapshots-dir", "not-a-models-repo", "outside-blobs"])
def test_only_the_hub_layout_allows_links_out(tmp_path, exported, layout):
    dirs, _ = exported
    if layout == "not-a-snapshots-dir":
        snap = _hub_snapshot(dirs[CT], tmp_path / "hub")
        other = snap.parent.parent / "refs" / "main"
        other.parent.mkdir()
        shutil.copytree(snap, other, symlinks=True)  # links into blobs/, but not from snapshots/<rev>
        snap = other
    elif layout == "not-a-models-repo":
        snap = _hub_snapshot(dirs[CT], tmp_path / "hub", repo="datasets--org--name")
    else:
        snap = _hub_snapshot(dirs[CT], tmp_path / "hub")
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", snap / "tokenizer.json")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(snap)


@pytest.mark.parametrize("text", [
    "[1]", "3", '"x"', '{"quantization_config": 3}', '{"quantization_config": []}',
    '{"quantization_config": {"blockscale": "x"}}', '{"quantization_config": {"blockscale": {"metadata": [1]}}}',
    '{"quantization_config": {"blockscale": {"metadata": {"model": 5}}}}', '{"a":', "\udcff", "[" * 100000,
])
def test_detection_never_raises_on_a_hostile_config(tmp_path, text):
    (tmp_path / "config.json").write_text(text, errors="surrogateescape")
    assert source_model(tmp_path) is None
    assert is_blockscale_checkpoint(tmp_path) is False


def test_detection_does_not_follow_links_out(tmp_path, exported):
    dirs, _ = exported
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(dirs[CT] / "config.json", d / "config.json")
    os.symlink(dirs[MO] / "hf_quant_config.json", d / "hf_quant_config.json")
    assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert is_blockscale_checkpoint(d) is False and source_model(d) is None
