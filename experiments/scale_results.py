"""PTQ cost on real models, as a user runs it: ``blockscale quantize MODEL --out OUT`` (the default path, which
streams) per model and method, one run at a time, each in a child process whose peak RSS (``ru_maxrss``,
imports included) and wall time are recorded, with the per-layer seconds from the command's progress lines
("layer i/n quantized and written (X s)") against the layer's parameter count (time scaling, issue 31).

    python experiments/fetch_qwen_gguf.py                      # the Qwen2.5-Coder GGUFs, once
    python experiments/scale_results.py --models qwen-1.5b --methods rtn gptq --json runs/scale_qwen15.json
    python experiments/scale_results.py --models qwen-1.5b --paths default no-streaming   # peak RSS of both paths
    python experiments/scale_results.py --models qwen-1.5b --methods rtn hessian --ppl-tokens 16384 --fp-ppl \
        --keep ~/.cache/blockscale/runs        # + WikiText-2 perplexity of each output and of the source (ctx 1024)

Models: ``smollm2`` (built in, 135M, Q4_1 GGUF), ``qwen-0.5b`` / ``qwen-1.5b`` (the assembled GGUFs in
``--cache``), ``synthetic`` (a 24-layer random Llama of 51 MB layers written to a temporary directory).
Methods: ``rtn``, ``hessian`` (RTN with Hessian-aware block scales: ``--scale-rule hessian``) and ``gptq``, the
calibrating ones on ``--n-samples`` x ``--seq-len`` tokens of the command's default calibration text.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
METHOD_FLAGS = {"rtn": ["--method", "rtn"], "hessian": ["--method", "rtn", "--scale-rule", "hessian"],
                "gptq": ["--method", "gptq"]}
_LAYER = re.compile(r"layer (\d+)/(\d+) quantized and written \(([0-9.]+) s\)")
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr[-3000:]); "
         "print('PEAK', r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def source(name: str, cache: Path, tmp: Path) -> str:
    if name == "smollm2":
        return "smollm2-135m"
    if name == "synthetic":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_streaming_memory import synthetic_dir

        return str(synthetic_dir(tmp, 24, hidden=1024, inter=2816))
    path = cache / GGUF[name]
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: run python experiments/fetch_qwen_gguf.py first")
    return str(path)


def layer_params(src: str) -> int:
    """Parameters of one decoder layer (from the model's config, built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if src == "smollm2-135m":
        from blockscale.models.hf import smollm2_gguf

        src = str(smollm2_gguf())
    p = Path(src)
    cfg = AutoConfig.from_pretrained(p.parent, gguf_file=p.name) if p.suffix == ".gguf" else \
        AutoConfig.from_pretrained(p)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(t.numel() for t in model.model.layers[0].parameters())


def run(src: str, method: str, out: Path, args, path: str = "default") -> dict:
    cmd = [sys.executable, "-m", "blockscale.cli", "quantize", src, "--out", str(out), *METHOD_FLAGS[method]]
    if path == "no-streaming":
        cmd.append("--no-streaming")
    if method != "rtn":
        cmd += ["--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len)]
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    wall = time.time() - t0
    code, peak = r.stdout.split("PEAK")[-1].split()
    if code != "0":
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    layers = [float(m.group(3)) for m in _LAYER.finditer(r.stdout)]
    return {"wall_s": wall, "peak_rss_mib": int(peak) / 2**20, "layers": len(layers), "layer_seconds": layers,
            "streamed": bool(layers), "stdout_tail": r.stdout.strip().splitlines()[-3:]}


def perplexity(model: str, args) -> dict:
    """``blockscale eval ppl MODEL`` on the first ``--ppl-tokens`` WikiText-2 test tokens (ctx 1024), timed."""
    with tempfile.TemporaryDirectory() as t:
        out = Path(t) / "ppl.json"
        cmd = [sys.executable, "-m", "blockscale.cli", "eval", "ppl", model, "--ctx", str(args.ppl_ctx),
               "--max-tokens", str(args.ppl_tokens), "--json", str(out)]
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        rec = json.loads(out.read_text())
    return {"ppl": rec.get("ppl"), "ppl_tokens": rec.get("tokens_evaluated"), "ppl_wall_s": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen-0.5b", "qwen-1.5b"],
                    choices=("smollm2", "qwen-0.5b", "qwen-1.5b", "synthetic"))
    ap.add_argument("--methods", nargs="+", default=["rtn"], choices=tuple(METHOD_FLAGS))
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--paths", nargs="+", default=["default"], choices=("default", "no-streaming"),
                    help="the default path (streams) and / or --no-streaming (the model loaded whole)")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/blockscale/models").expanduser())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ppl-tokens", type=int, default=0,
                    help="also the WikiText-2 test perplexity of every output on its first N tokens (0: none)")
    ap.add_argument("--ppl-ctx", type=int, default=1024)
    ap.add_argument("--fp-ppl", action="store_true", help="and of each source model in full precision")
    ap.add_argument("--keep", type=Path, help="write the outputs under this directory and keep them (a new "
                    "subdirectory per model, method and path; refused if it exists)")
    args = ap.parse_args(argv)
    if args.ppl_tokens < 0 or args.ppl_ctx < 2:
        ap.error(f"--ppl-tokens {args.ppl_tokens} / --ppl-ctx {args.ppl_ctx}: allowed values are >= 0 and >= 2")
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        outs = args.keep.expanduser() if args.keep else tmp
        outs.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            src = source(name, args.cache, tmp)
            per_layer = layer_params(src)
            if args.fp_ppl:
                row = {"model": name, "method": "full precision", "path": "", **perplexity(src, args)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            for method, path in [(m, p) for m in args.methods for p in args.paths]:  # one run at a time
                out = outs / f"{name}-{method}-{path}"
                if out.exists():
                    raise SystemExit(f"error: --keep: {out} exists; choose another directory")
                row = {"model": name, "method": method, "path": path, "layer_params": per_layer,
                       **run(src, method, out, args, path)}
                if args.ppl_tokens:
                    row.update(perplexity(str(out), args))
                sec = sorted(row["layer_seconds"])
                row["median_layer_s"] = sec[len(sec) // 2] if sec else None
                print(json.dumps({k: v for k, v in row.items() if k != "layer_seconds"}), flush=True)
                rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
