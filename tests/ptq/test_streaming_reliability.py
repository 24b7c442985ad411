"""Streaming PTQ under hostile or careless use (issue 29): resume on re-saved weights, corrupt work files,
--offload-activations in the wrong place, old checkpoints' extra tensors, full disks and file-size limits.

A "killed" run is simulated in process: ``on_layer`` raises once layer 0 is recorded (the work directory is
then exactly what a SIGKILL at that moment leaves; the real SIGKILL is test_ptq_streaming.py's)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockscale.ptq.stream_state as stream_state
from blockscale.errors import CheckpointError, UsageError
from blockscale.file_errors import FileWriteError
from blockscale.ptq import PTQConfig
from blockscale.ptq.streaming import quantize_streaming
from tiny_models import tiny_hf_llama, token_ids

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
CALIB = token_ids(4, 16, vocab=96)
RTN, GPTQ = PTQConfig(method="rtn"), PTQConfig(method="gptq", n_samples=4, seq_len=16, batch_size=2)


class Stop(Exception):
    pass


def _save(d: Path, seed: int = 0, tokenizer: bool = False) -> Path:
    tiny_hf_llama(seed).save_pretrained(d)
    if tokenizer:
        from blockscale.models.hf_moe_export import byte_transformers_tokenizer

        byte_transformers_tokenizer().save_pretrained(d)
    return d


def _run(src, out, cfg=RTN, stop_after=None, **kw):
    def on_layer(i, phase, _model):
        if phase == "released" and i == stop_after:
            raise Stop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_streaming(src, out, cfg, CALIB if cfg.needs_calibration else None, progress=False,
                                  on_layer=on_layer, **kw)


def _tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same(a: Path, b: Path):
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A GPTQ run stopped after layer 0 (work directory with part / skeleton / inputs / hidden files)."""
    root = tmp_path_factory.mktemp("stopped")
    src = _save(root / "src")
    with pytest.raises(Stop):
        _run(src, root / "out", GPTQ, stop_after=0)
    return src, root / ".out.streaming"


def _copy_stopped(stopped, tmp_path) -> tuple[Path, Path, Path]:
    src, work = stopped
    shutil.copytree(work, tmp_path / ".out.streaming")
    return src, tmp_path / "out", tmp_path / ".out.streaming"


def test_resume_refuses_a_model_resaved_with_other_weights_of_the_same_sizes(tmp_path):
    src = _save(tmp_path / "src")
    ref = _run(src, tmp_path / "ref") and tmp_path / "ref"
    with pytest.raises(Stop):
        _run(src, tmp_path / "out", stop_after=0)
    sizes = {p.name: p.stat().st_size for p in src.iterdir()}
    _save(src, seed=1)  # a fine-tune saved over it: same config, same byte sizes, other weights
    assert {p.name: p.stat().st_size for p in src.iterdir()} == sizes
    with pytest.raises(UsageError, match=r"another source model \(config.json, index or the shards' contents\)"):
        _run(src, tmp_path / "out", resume=True)
    _save(src, seed=0)  # the original weights again, in new files (new times): hashed again, accepted
    _run(src, tmp_path / "out", resume=True)
    _same(ref, tmp_path / "out")


def test_source_digests_are_reused_only_for_unchanged_files(tmp_path, monkeypatch):
    src = _save(tmp_path / "src")
    hashed = []
    real = stream_state.file_sha256
    monkeypatch.setattr(stream_state, "file_sha256", lambda p, cb=None: hashed.append(p.name) or real(p, cb))
    monkeypatch.setattr(stream_state, "RECENT_NS", 0)
    first = stream_state.source_files(src)
    assert hashed == ["model.safetensors"] and first["model.safetensors"]["trusted"]
    assert stream_state.source_files(src, first) == first and hashed == ["model.safetensors"]  # stat unchanged
    os.utime(src / "model.safetensors")  # touched: hashed again, same digest
    again = stream_state.source_files(src, first)
    assert len(hashed) == 2 and again["model.safetensors"]["sha256"] == first["model.safetensors"]["sha256"]
    monkeypatch.setattr(stream_state, "RECENT_NS", 10**18)  # a file changed just now is never trusted by its stat
    recent = stream_state.source_files(src)
    assert not recent["model.safetensors"]["trusted"]
    stream_state.source_files(src, recent)
    assert len(hashed) == 4


def _truncate(f: Path):
    b = f.read_bytes()
    f.write_bytes(b[: len(b) // 2])


def _state(work: Path, **changes):
    s = json.loads((work / "state.json").read_text())
    s.update(changes)
    (work / "state.json").write_text(json.dumps(s))


@pytest.mark.parametrize("damage,named", [
    (lambda w: _truncate(w / "part-00000.safetensors"), "part-00000.safetensors: streaming work file is corrupt"),
    (lambda w: _truncate(w / "skeleton-00000.safetensors"), "skeleton-00000.safetensors: streaming work file is"),
    (lambda w: (w / "part-00000.safetensors").unlink(), "part-00000.safetensors: missing"),
    (lambda w: _state(w, done=5), "state.json: done=5 is not a layer count of this model (0..2)"),
    (lambda w: _state(w, done="1"), "state.json: done='1' is not a layer count"),
    (lambda w: _state(w, records={}), "state.json: records of the 1 finished layer(s) are missing"),
    (lambda w: (w / "state.json").write_text("{\"marker\": \"blockscale-str"), "state.json: the streaming run's state is "
                                                                                 "corrupt"),
    (lambda w: _truncate(w / "inputs.pt"), "inputs.pt: streaming work file is corrupt or truncated"),
    (lambda w: [f.unlink() for f in w.glob("hidden-*")], "hidden-00001-00000.safetensors: missing"),
], ids=["part", "skeleton", "part-missing", "done-too-large", "done-not-int", "records", "state-json", "inputs",
        "hidden"])
def test_resume_with_damaged_work_files_names_the_file(stopped, tmp_path, damage, named):
    src, out, work = _copy_stopped(stopped, tmp_path)
    damage(work)
    with pytest.raises(CheckpointError, match="remove .* to start over") as e:
        _run(src, out, GPTQ, resume=True)
    assert named in str(e.value)
    assert not out.exists()


def test_truncated_source_shard_is_one_line_naming_it(tmp_path, capsys):
    from blockscale.cli.main import main

    src = _save(tmp_path / "src")
    _truncate(src / "model.safetensors")
    assert main(["quantize", str(src), "--streaming", "--out", str(tmp_path / "out")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockscale")]
    assert len(err) == 1 and f"{src / 'model.safetensors'}: safetensors file is corrupt or truncated" in err[0]
    assert "internal error" not in err[0] and not (tmp_path / "out").exists()


def test_old_checkpoints_extra_tensors_are_ignored_by_both_paths(tmp_path):
    """rotary_emb.inv_freq of old Llama exports: from_pretrained ignores it, so streaming does too."""
    from blockscale.cli.main import main

    src = _save(tmp_path / "src")
    sd = load_file(str(src / "model.safetensors"))
    sd.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)})
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert main(["quantize", str(src), "--no-streaming", "--out", str(tmp_path / "mem")]) == 0
    assert main(["quantize", str(src), "--streaming", "--out", str(tmp_path / "str")]) == 0
    _same(tmp_path / "mem", tmp_path / "str")


@pytest.mark.parametrize("where", ["source", "out", "work", "file"])
def test_offload_activations_in_the_wrong_place_is_refused_up_front(tmp_path, where):
    src = _save(tmp_path / "src")
    (tmp_path / "a-file").write_text("mine")
    acts = {"source": src / "acts", "out": tmp_path / "out", "work": tmp_path / ".out.streaming" / "a",
            "file": tmp_path / "a-file"}[where]
    with pytest.raises(UsageError, match="offload_activations"):
        _run(src, tmp_path / "out", GPTQ, offload_activations=acts)
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.streaming").exists()
    assert (tmp_path / "a-file").read_text() == "mine"


def test_resume_with_another_offload_directory_is_refused(tmp_path):
    src = _save(tmp_path / "src")
    with pytest.raises(Stop):
        _run(src, tmp_path / "out", GPTQ, stop_after=0, offload_activations=tmp_path / "acts")
    with pytest.raises(UsageError, match="the run was started with --offload-activations .*acts; resume with the same"):
        _run(src, tmp_path / "out", GPTQ, resume=True, offload_activations=tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "acts")
    with pytest.raises(CheckpointError, match="acts, which is gone"):
        _run(src, tmp_path / "out", GPTQ, resume=True)


def test_full_disk_in_the_work_directory_names_the_file_and_leaves_no_partial(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def full(*_a, **_k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    src = _save(tmp_path / "src")
    monkeypatch.setattr(stream_state, "save_file", full)
    with pytest.raises(FileWriteError, match=r"could not write .*part-00000.safetensors: no space left on device"):
        _run(src, tmp_path / "out")
    assert not list((tmp_path / ".out.streaming").glob("*.partial"))


def test_full_disk_during_export_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import blockscale.export.writer as writer
    from blockscale.cli.main import main

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    src = _save(tmp_path / "src")
    monkeypatch.setattr(writer, "save_file", full)  # the in-memory export (streaming keeps its work directory)
    assert main(["quantize", str(src), "--no-streaming", "--out", str(tmp_path / "out")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockscale")]
    assert len(err) == 1 and "model.safetensors: no space left on device" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary directory


def test_file_size_limit_during_export_is_one_line_and_writes_nothing(tmp_path):
    """A real EFBIG: the export runs in a child process under RLIMIT_FSIZE (safetensors then raises
    'SafetensorError: ... File too large (os error 27)')."""
    src = _save(tmp_path / "src")
    limit = 64 << 10  # the model's shard is ~500 kB

    def child():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = subprocess.run([sys.executable, "-m", "blockscale.cli", "quantize", str(src), "--no-streaming", "--out",
                        str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT, preexec_fn=child, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "BLOCKSCALE_COMPILE_AFTER": "never"})
    err = [line for line in p.stderr.splitlines() if ": error: " in line]
    assert p.returncode == 1 and len(err) == 1, p.stderr
    assert "model.safetensors: the file-size limit was reached (ulimit -f)" in err[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["src"]
