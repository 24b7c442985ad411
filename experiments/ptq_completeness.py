"""Issue 18 item 5: AWQ auto-clip and GPTQ true-sequential on SmolLM2-135M W4A16 (WikiText-2 ppl).

    python experiments/ptq_completeness.py --out runs/ptq-completeness            # resumable
    python experiments/ptq_completeness.py --out runs/ptq-completeness --only clip
    python experiments/ptq_completeness.py --model stories260k --n-samples 128 --eval-tokens 0 --only AWQ \
        --out runs/ptq-completeness-stories260k

Calibration and evaluation as experiments/ptq_results.py (docs/results/ptq.md): 32 random c4 windows of 512
tokens, the first 16384 tokens of WikiText-2 test at ctx 1024, no BOS. Each finished configuration is a line
of OUT/results.jsonl; a rerun skips it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from blockscale.models.hf import load_model
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import default_texts, evaluate_ppl, quantized_copy

CONFIGS = [
    ("GPTQ", dict(method="gptq")),
    ("GPTQ true-sequential", dict(method="gptq", options=GPTQOptions(true_sequential=True))),
    ("GPTQ+4/6 (aware)", dict(method="gptq", scale_rule="4over6")),
    ("GPTQ+4/6 (aware) true-sequential", dict(method="gptq", scale_rule="4over6",
                                              options=GPTQOptions(true_sequential=True))),
    ("AWQ+4/6", dict(method="awq", scale_rule="4over6", options=AWQOptions(clip=False))),
    ("AWQ+4/6 clip", dict(method="awq", scale_rule="4over6", options=AWQOptions(clip=True))),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs/ptq-completeness")
    p.add_argument("--activations", default="w4a16", choices=("w4a16", "w4a4"))
    p.add_argument("--eval", help="evaluation text source (default: wikitext2; tinystories#0:0.8 for stories260k)")
    p.add_argument("--eval-tokens", type=int, default=16384, help="first N tokens (0: all)")
    p.add_argument("--n-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--only", nargs="+", help="run only configurations whose label contains one of these strings")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done_file = out / "results.jsonl"
    done = {json.loads(line)["key"] for line in done_file.read_text().splitlines()} if done_file.exists() else set()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    d = default_texts(args.model)
    eval_src = args.eval or ("tinystories#0:0.8" if args.model == "stories260k" else d.eval)
    eval_tokens = args.eval_tokens or None
    skip_indivisible = args.model == "stories260k"  # its MLP width 172 is not a multiple of 16

    def record(key, rec, seconds):
        with open(done_file, "a") as f:
            f.write(json.dumps({"key": key, "ppl": rec.ppl, "loss": rec.loss, "tokens": rec.tokens_evaluated,
                                "quantize_seconds": seconds}) + "\n")
        print(f"{key:48s} ppl {rec.ppl:8.4f}  quantize {seconds:6.1f} s", flush=True)

    for label, fields in [("fp", None), *CONFIGS]:
        key = f"{label} {args.activations}" if fields is not None else "fp"
        if key in done or (args.only and fields is not None and not any(o in label for o in args.only)):
            continue
        if fields is None:
            if args.only:
                continue
            record(key, evaluate_ppl(lm.model, lm.tokenizer, eval_src, d.ctx, d.bos, eval_tokens), 0.0)
            continue
        cfg = PTQConfig(activations=args.activations, n_samples=args.n_samples, seq_len=args.seq_len,
                        skip_indivisible=skip_indivisible, **fields)
        t0 = time.time()
        qm, _ = quantized_copy(lm.model, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
        seconds = time.time() - t0
        record(key, evaluate_ppl(qm, lm.tokenizer, eval_src, d.ctx, d.bos, eval_tokens), seconds)
        del qm
    return 0


if __name__ == "__main__":
    sys.exit(main())
