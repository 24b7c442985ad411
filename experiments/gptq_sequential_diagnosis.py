"""Why GPTQ true-sequential is worse than plain GPTQ on SmolLM2-135M W4A16 (issue 32 item 5).

    python experiments/gptq_sequential_diagnosis.py --out runs/gptq-seq          # ~5 min on 2 cores

Both variants quantize the same calibration windows (32 x 512 c4 tokens, as docs/results/ptq.md). For each,
the relative error of every decoder layer's output hidden state against the full-precision model's,
||h_q - h_fp||^2 / ||h_fp||^2 summed over tokens, on (a) the calibration windows themselves and (b) held-out
windows (WikiText-2 test, 8 x 512 tokens), plus the WikiText-2 perplexity (first 16384 tokens, ctx 1024). If
true-sequential fits the calibration windows better but generalises worse, it over-fits them; if it is worse on
both, its objective (each later stage reproduces W X_q, the full-precision weights on the already-quantized
inputs) is the cause. Writes OUT/diagnosis.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from blockscale.data.text_sources import calibration_batches
from blockscale.models.hf import load_model
from blockscale.ptq import GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import default_texts, evaluate_ppl, quantized_copy


@torch.no_grad()
def hidden_states(model, windows: torch.Tensor, batch: int = 4) -> list[torch.Tensor]:
    """Per decoder layer output (hidden_states[1:]) of every window, FP32 [n, T, H] each."""
    outs = None
    for i in range(0, windows.shape[0], batch):
        hs = model(windows[i:i + batch], output_hidden_states=True).hidden_states[1:]
        hs = [h.float() for h in hs]
        outs = hs if outs is None else [torch.cat([a, b]) for a, b in zip(outs, hs)]
    return outs


def relative_errors(q: list[torch.Tensor], fp: list[torch.Tensor]) -> list[float]:
    return [float(((a - b) ** 2).sum() / (b ** 2).sum()) for a, b in zip(q, fp)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs/gptq-seq")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model)
    d = default_texts(args.model)
    base = dict(method="gptq", n_samples=32, seq_len=512)
    calib = calibration_batches(lm.tokenizer, d.calib, base["n_samples"], base["seq_len"], seed=PTQConfig().seed,
                                bos=d.calib_bos)
    held = calibration_batches(lm.tokenizer, d.eval, 8, 512, seed=1, bos=False)
    fp_calib, fp_held = hidden_states(lm.model, calib), hidden_states(lm.model, held)
    rows = {}
    for label, options in (("plain", GPTQOptions()), ("true-sequential", GPTQOptions(true_sequential=True))):
        t0 = time.time()
        qm, _ = quantized_copy(lm.model, lm.tokenizer, PTQConfig(options=options, **base), d.calib, d.calib_bos,
                               progress=False)
        seconds = time.time() - t0
        ppl = evaluate_ppl(qm, lm.tokenizer, d.eval, d.ctx, d.bos, 16384).ppl
        rows[label] = {"ppl": ppl, "quantize_seconds": seconds,
                       "calib": relative_errors(hidden_states(qm, calib), fp_calib),
                       "held_out": relative_errors(hidden_states(qm, held), fp_held)}
        print(f"{label}: ppl {ppl:.4f}, {seconds:.0f} s", flush=True)
        del qm
    (out / "diagnosis.json").write_text(json.dumps(rows, indent=1))
    print("| layer | calibration: plain | true-seq | held-out: plain | true-seq |")
    print("|---:|---:|---:|---:|---:|")
    a, b = rows["plain"], rows["true-sequential"]
    for i in range(len(a["calib"])):
        print(f"| {i} | {a['calib'][i]:.4f} | {b['calib'][i]:.4f} | {a['held_out'][i]:.4f} | {b['held_out'][i]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
