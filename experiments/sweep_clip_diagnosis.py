"""Is it the clipping candidates of the Hessian-aware sweep (block scales below scale-to-6, which clip a block's
largest weight) that make rule "hessian" worse than RTN-6 on Qwen2.5-Coder-0.5B (issue 32)?

    python experiments/sweep_clip_diagnosis.py --model MODEL            # RTN hessian W4A16, every candidate
    python experiments/sweep_clip_diagnosis.py --model MODEL --noclip   # ... only candidates >= scale-to-6

MODEL is one of experiments/recovery_results.py's (same calibration and evaluation); prints the perplexity and
the share of weight blocks whose chosen scale is below / above scale-to-6. ``--noclip`` runs the sweep with
``fast_sweep_scales(..., clip=False)`` in place of the rule's (an option of the sweep that no PTQ rule uses).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402
from blockscale.quant.nvfp4 import sweep_fast, weighted  # noqa: E402
from blockscale.quant.nvfp4.scales import BLOCK, block_amax, block_scales  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(R.MODELS))
    ap.add_argument("--noclip", action="store_true")
    args = ap.parse_args(argv)
    spec, lm, d = R.model_and_texts(args.model)
    torch.manual_seed(0)
    counts = {"blocks": 0, "below6": 0, "above6": 0}

    def sweep(xf, S, wf=None):
        out = sweep_fast.fast_sweep_scales(xf, S, wf, clip=not args.noclip)
        s6 = block_scales(block_amax(xf.view(-1, 1, BLOCK)), S.reshape(1, 1, 1), 6).reshape(-1)
        counts["blocks"] += out.numel()
        counts["below6"] += int((out < s6).sum())
        counts["above6"] += int((out > s6).sum())
        return out

    weighted.fast_sweep_scales = sweep
    student = copy.deepcopy(lm.model)
    cfg = PTQConfig(activations="w4a16", n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                    skip_indivisible=spec["skip_indivisible"], method="rtn", scale_rule="hessian")
    t = time.time()
    calibrate_and_quantize(student, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
    sec = time.time() - t
    print(json.dumps({"model": args.model, "noclip": args.noclip, "ppl": R._ppl(student, lm, spec, d),
                      "ptq_seconds": sec, **counts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
