"""Streaming PTQ (``ptq.streaming``): one decoder layer in memory at a time, the checkpoint identical to
``quantize_model`` + ``export_checkpoint`` on the fully loaded model, resumable after a kill at any point.

Identity: every safetensors file has the same header (parsed: names, dtypes, shapes, offsets, metadata with
the tensor digests) and the same data bytes; config.json, the index and the other files are byte-identical;
blockscale_report.json equal but for "created". (safetensors writes its ``__metadata__`` keys in hash
order, which differs between two calls of the same in-memory export, so whole-file bytes are not compared.)
"""
from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from blockscale.errors import UsageError
from blockscale.export import export_checkpoint
from blockscale.models.hf import load_model
from blockscale.models.hf_streaming import real_bytes
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.streaming import quantize_streaming

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
CALIB = torch.Generator().manual_seed(1)
CALIB_IDS = torch.randint(0, 128, (4, 16), generator=CALIB)
SHARD = "20KB"  # output shards: several, so the split and the index are compared too


def _write_llama(d: Path, layers=3, hidden=64, inter=128, vocab=128, shard="200KB", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d, max_shard_size=shard)
    return d


def _write_mixtral(d: Path):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    MixtralForCausalLM(cfg).save_pretrained(d, max_shard_size="200KB")
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    out = {"llama": _write_llama(root / "llama"), "mixtral": _write_mixtral(root / "mixtral")}
    for d in out.values():
        assert len(list(d.glob("model-*.safetensors"))) == 3  # 3 shards + index, as the issue asks
    return out


def _files(d: Path) -> dict:
    out = {}
    for p in sorted(d.iterdir()):
        b = p.read_bytes()
        if p.suffix == ".safetensors":
            n = struct.unpack("<Q", b[:8])[0]
            out[p.name] = (json.loads(b[8:8 + n]), b[8 + n:])
        elif p.name == "blockscale_report.json":
            rep = json.loads(b)
            rep.pop("created")
            out[p.name] = rep
        else:
            out[p.name] = b
    return out


def _assert_same(a: Path, b: Path):
    fa, fb = _files(a), _files(b)
    assert list(fa) == list(fb)
    for name in fa:
        assert fa[name] == fb[name], name
    assert any(n.endswith(".safetensors.index.json") for n in fa)


def _in_memory(src, out, cfg, fmt, calib=CALIB_IDS):
    lm = load_model(str(src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(lm.model, cfg, calib if cfg.needs_calibration else None, progress=False)
    export_checkpoint(lm.model, out, fmt, max_shard_size=SHARD, metadata={"run": "test"}, source=src)
    return out


def _streaming(src, out, cfg, fmt, calib=CALIB_IDS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_streaming(src, out, cfg, calib if cfg.needs_calibration else None, fmt,
                                  max_shard_size=SHARD, metadata={"run": "test"}, progress=False, **kw)


def _cfg(method, recipe=None):
    kw = dict(method=method, n_samples=4, seq_len=16, batch_size=2)
    return PTQConfig(recipe=recipe, **kw) if recipe else PTQConfig(**kw)


CASES = [("llama", "rtn", None, "compressed-tensors"), ("llama", "rtn", None, "modelopt"),
         ("llama", "gptq", None, "compressed-tensors"), ("llama", "gptq", None, "modelopt"),
         ("llama", "awq", None, "compressed-tensors"), ("llama", "awq", None, "modelopt"),
         ("llama", "gptq", "nvfp4-experts-fp8-attention", "compressed-tensors"),
         ("llama", "rtn", "mxfp4-w4a16", "compressed-tensors"), ("llama", "awq", "fp8", "modelopt"),
         ("llama", "smoothquant", "fp8", "compressed-tensors"), ("llama", "autoround", None, "modelopt"),
         ("llama", "autoround", "nvfp4-experts-fp8-attention", "compressed-tensors"),
         ("mixtral", "rtn", None, "compressed-tensors"), ("mixtral", "rtn", None, "modelopt"),
         ("mixtral", "gptq", None, "compressed-tensors"), ("mixtral", "gptq", None, "modelopt"),
         ("mixtral", "rtn", "nvfp4-experts-fp8-attention", "compressed-tensors")]


@pytest.mark.parametrize("model,method,recipe,fmt", CASES, ids=["-".join(str(x) for x in c) for c in CASES])
def test_streaming_equals_in_memory(models, tmp_path, model, method, recipe, fmt):
    src, cfg = models[model], _cfg(method, recipe)
    ref = _in_memory(src, tmp_path / "ref", cfg, fmt)
    seen = []

    def on_layer(i, phase, m):
        layers = m.model.layers
        seen.append((i, phase))
        per_layer = max(real_bytes(layers[j]) for j in range(len(layers))) if phase == "loaded" else None
        assert all(real_bytes(layers[j]) == 0 for j in range(i + 1, len(layers)))  # later layers: meta only
        if per_layer is not None:  # the layer just loaded, the others released: all of them < 5% of one layer
            assert real_bytes(layers[i]) == per_layer
            assert 20 * sum(real_bytes(layers[j]) for j in range(len(layers)) if j != i) < per_layer
    _streaming(src, tmp_path / "out", cfg, fmt, on_layer=on_layer)
    _assert_same(ref, tmp_path / "out")
    n = len(load_model(str(src)).model.model.layers)
    assert seen == [(i, p) for i in range(n) for p in ("loaded", "released")]
    assert not (tmp_path / ".out.streaming").exists()  # the work directory is removed on success


def test_the_steps_of_a_streaming_run(models, tmp_path):
    """``StreamingQuantizer``: resume() / process_layer(i) / export() called one by one write what
    quantize_streaming writes; a run stopped after a layer resumes at the next one."""
    from blockscale.ptq import StreamingOptions, StreamingQuantizer

    src, cfg = models["llama"], _cfg("gptq")
    ref = _in_memory(src, tmp_path / "ref", cfg, "compressed-tensors")

    def quantizer(resume=False):
        opts = StreamingOptions(max_shard_size=SHARD, metadata={"run": "test"}, progress=False, resume=resume)
        return StreamingQuantizer(src, tmp_path / "out", cfg, CALIB_IDS, "compressed-tensors", opts)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = quantizer()
        assert first.resume() == 0
        first.process_layer(0)  # then stopped: the work directory records layer 0
        second = quantizer(resume=True)
        assert second.resume() == 1
        for i in range(1, len(second.layers)):
            second.process_layer(i)
        report = second.export()
    assert len(report.linears) == 7 * 3
    _assert_same(ref, tmp_path / "out")
    assert not (tmp_path / ".out.streaming").exists()
    with pytest.raises(TypeError, match="unexpected keyword argument 'shard_size'"):
        quantize_streaming(src, tmp_path / "o2", cfg, CALIB_IDS, shard_size="20KB")


def test_released_layers_hold_only_small_tensors(models, tmp_path):
    """After each layer: the released layers keep only their scales (< 1% of a float layer's bytes)."""
    src = models["llama"]
    float_layer = real_bytes(load_model(str(src)).model.model.layers[0])
    kept = []
    _streaming(src, tmp_path / "out", _cfg("gptq"), "compressed-tensors",
               on_layer=lambda i, ph, m: ph == "released" and kept.append(real_bytes(m.model.layers)))
    assert len(kept) == 3 and max(kept) * 100 < float_layer * 3


@pytest.mark.parametrize("method", ["gptq", "autoround"])
def test_offload_activations(models, tmp_path, method):
    src, cfg = models["llama"], _cfg(method)
    ref = _in_memory(src, tmp_path / "ref", cfg, "compressed-tensors")
    mine = tmp_path / "acts"
    mine.mkdir()
    (mine / "user.txt").write_text("not ours")
    seen = []
    _streaming(src, tmp_path / "out", cfg, "compressed-tensors", offload_activations=mine,
               on_layer=lambda i, ph, m: seen.append(sorted(p.name for p in mine.iterdir())))
    _assert_same(ref, tmp_path / "out")
    assert any(any(n.startswith("hidden-") for n in names) for names in seen)  # the activations were on disk
    assert sorted(p.name for p in mine.iterdir()) == ["user.txt"]  # ours removed, the user's file kept


_CHILD = textwrap.dedent("""
    import os, signal, sys, warnings, torch
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from blockscale.ptq import PTQConfig
    from blockscale.ptq.streaming import quantize_streaming
    src, out, method = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
    calib = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    cfg = PTQConfig(method=method, n_samples=4, seq_len=16, batch_size=2)
    def on_layer(i, phase, m):
        print(phase, i, flush=True)
        if phase == "released" and i == kill_after:  # layer i is recorded in the work directory
            os.kill(os.getpid(), signal.SIGKILL)
    quantize_streaming(src, out, cfg, calib if cfg.needs_calibration else None, "compressed-tensors",
                       max_shard_size="20KB", metadata={"run": "test"}, progress=False, on_layer=on_layer)
    print("finished", flush=True)
""")


def _child(src, out, method, kill_after=None):
    """The run in a child process, printing each ``on_layer`` call; ``kill_after``: it SIGKILLs itself once
    that layer is recorded."""
    argv = [sys.executable, "-c", _CHILD, str(src), str(out), method]
    if kill_after is not None:
        argv.append(str(kill_after))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)


@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)])  # 1 in make test
def test_kill_after_layer_and_resume(models, tmp_path, k):
    src, cfg = models["llama"], _cfg("gptq")
    ref = _in_memory(src, tmp_path / "ref", cfg, "compressed-tensors")
    p = _child(src, tmp_path / "out", "gptq", kill_after=k)
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err
    assert f"released {k}" in out and "finished" not in out
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.streaming" / "state.json").is_file()
    with pytest.raises(UsageError, match="pass resume=True"):  # never silently restarted or overwritten
        _streaming(src, tmp_path / "out", cfg, "compressed-tensors")
    loaded = []
    _streaming(src, tmp_path / "out", cfg, "compressed-tensors", resume=True,
               on_layer=lambda i, ph, m: ph == "loaded" and loaded.append(i))
    assert loaded == list(range(k + 1, 3))  # restarted at the first unfinished layer
    _assert_same(ref, tmp_path / "out")
    assert not (tmp_path / ".out.streaming").exists()


def test_sigkill_at_a_random_moment_and_resume(models, tmp_path):
    src, cfg = models["llama"], _cfg("gptq")
    ref = _in_memory(src, tmp_path / "ref", cfg, "compressed-tensors")
    rng = random.Random(int(time.time()))
    for attempt in range(3):  # each attempt kills the previous run's resume, at a random moment after it starts
        p = _child(src, tmp_path / "out", "gptq")
        first = p.stdout.readline()  # the first layer loaded: the run is under way
        time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        if (tmp_path / "out").exists():
            break  # it finished before the kill
        assert first.startswith("loaded") or p.returncode == -signal.SIGKILL
        if (tmp_path / ".out.streaming").exists():
            _streaming(src, tmp_path / "out", cfg, "compressed-tensors", resume=True)
            break
    else:
        _streaming(src, tmp_path / "out", cfg, "compressed-tensors")
    _assert_same(ref, tmp_path / "out")
    assert not (tmp_path / ".out.streaming").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_resume_with_other_inputs_is_refused(models, tmp_path):
    src = models["llama"]
    p = _child(src, tmp_path / "out", "gptq", kill_after=0)
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    with pytest.raises(UsageError, match="made with another PTQ config and calibration set;"):  # rtn: none
        _streaming(src, tmp_path / "out", _cfg("rtn"), "compressed-tensors", resume=True)
    with pytest.raises(UsageError, match="made with another calibration set;"):  # other calibration ids
        _streaming(src, tmp_path / "out", _cfg("gptq"), "compressed-tensors", calib=CALIB_IDS.flip(0), resume=True)
    with pytest.raises(UsageError, match="made with another checkpoint format, dtype or device;"):
        _streaming(src, tmp_path / "out", _cfg("gptq"), "modelopt", resume=True)
    assert (tmp_path / ".out.streaming" / "state.json").is_file()  # refused runs leave the work directory alone


def test_foreign_work_directory_is_never_touched(models, tmp_path):
    wd = tmp_path / ".out.streaming"
    wd.mkdir()
    (wd / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not a streaming work directory"):
        _streaming(models["llama"], tmp_path / "out", _cfg("rtn"), "compressed-tensors")
    assert (wd / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flag", [[], ["--streaming"]], ids=["default", "explicit"])
def test_cli_streaming(models, tmp_path, capsys, flag):
    """A local safetensors directory streams by default (issue 31), the checkpoint that of --no-streaming."""
    from blockscale.cli.main import main

    out = tmp_path / "cli"
    assert main(["quantize", str(models["llama"]), "--out", str(out), *flag, "--max-shard-size", "20KB"]) == 0
    text = capsys.readouterr().out
    assert "layer 1/3 quantized and written" in text and "layer 3/3" in text and "(streaming)" in text
    ref = tmp_path / "ref"
    assert main(["quantize", str(models["llama"]), "--out", str(ref), "--no-streaming", "--max-shard-size",
                 "20KB"]) == 0
    text = capsys.readouterr().out
    assert "layer 1/3" not in text and "not streaming" not in text and f"loading {models['llama']}" in text
    fa, fb = _files(out), _files(ref)
    assert list(fa) == list(fb)
    for name in fa:
        if name.endswith(".safetensors"):  # config.json's summary holds the run's seconds
            assert fa[name][1] == fb[name][1]
            ha, hb = dict(fa[name][0]), dict(fb[name][0])
            ha.pop("__metadata__"), hb.pop("__metadata__")
            assert ha == hb


@pytest.mark.parametrize("argv,msg", [
    (["stories260k", "--streaming"], "--streaming: stories260k is not a transformers checkpoint"),
    (["LLAMA", "--resume", "--no-streaming"], "--resume needs streaming"),
    (["LLAMA", "--offload-activations", "x", "--no-streaming"], "--offload-activations needs streaming"),
    (["LLAMA", "--resume", "--eval"], "--resume needs streaming, but --eval measures perplexity on the whole model"),
    (["LLAMA", "--streaming", "--eval"], "--streaming: --eval measures perplexity on the whole model"),
])
def test_cli_streaming_errors(models, tmp_path, capsys, argv, msg):
    from blockscale.cli.main import main

    argv = [str(models["llama"]) if a == "LLAMA" else a for a in argv]
    assert main(["quantize", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
    assert not (tmp_path / "o").exists()


_RSS = textwrap.dedent("""
    import sys, warnings, torch
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from blockscale.ptq import PTQConfig, quantize_model
    from blockscale.ptq.streaming import quantize_streaming
    from blockscale.export import export_checkpoint
    from blockscale.models.hf import load_model
    import transformers.models.llama.modeling_llama  # (imports paid before the baseline)
    import blockscale as bs
    bs.set_backend("reference")  # eager kernels: no torch.compile memory in the measurement
    src, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = PTQConfig(method="rtn")
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) left by the imports
        f.write("5")
    base = status("VmRSS")
    if mode == "streaming":
        quantize_streaming(src, out, cfg, None, max_shard_size="8MB", progress=False)
    else:
        lm = load_model(src)
        quantize_model(lm.model, cfg, progress=False)
        export_checkpoint(lm.model, out, max_shard_size="8MB")
    print(status("VmHWM") - base)  # the peak RSS of the run above its start
""")


@pytest.mark.slow  # about a minute on 2 busy cores (two subprocesses on a 256 MB model)
def test_peak_rss_is_flat_in_the_layers(tmp_path):
    """16 decoder layers of 16 MB (fp32): materializing the model costs > 256 MB more peak RSS; streaming
    must stay under half of that (measured: about 5 layers' worth: the float layer being quantized, its
    loading copy, the quantizer's temporaries on its largest matrix, the exported copy; and one 8 MB output
    shard at the end), whatever the number of layers. Peak = VmHWM after resetting it
    (/proc/self/clear_refs) once the imports are done."""
    src = _write_llama(tmp_path / "big", layers=16, hidden=512, inter=2048, vocab=256, shard="100MB")
    layer = (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048) * 4
    assert 15e6 < layer < 17e6

    def peak(mode):
        r = subprocess.run([sys.executable, "-c", _RSS, str(src), str(tmp_path / mode), mode], capture_output=True,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.strip().splitlines()[-1])

    streaming = peak("streaming")
    assert streaming < 8 * layer, f"streaming peak +{streaming / 1e6:.0f} MB, one layer {layer / 1e6:.0f} MB"
    in_memory = peak("in-memory")
    assert in_memory > 16 * layer  # the bound above catches a materialized model


def test_cli_falls_back_in_one_line_where_streaming_cannot_serve(tmp_path, capsys):
    """stories260k is not a transformers checkpoint: the default path says so in one line and loads it whole."""
    from blockscale.cli.main import main

    assert main(["quantize", "stories260k", "--skip-indivisible", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    notes = [ln for ln in lines if ln.startswith("not streaming")]
    assert notes == ["not streaming stories260k: stories260k is not a transformers checkpoint; loading it whole"]
    assert not any("quantized and written" in ln for ln in lines)
