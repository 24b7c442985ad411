"""Do the first-token (attention-sink) activations of Qwen2.5-Coder-0.5B dominate its calibration statistics, and
are they why the Hessian-aware block scales are worse than RTN-6 there (issue 32; docs/results/recovery-models.md)?

    python experiments/qwen_sink_diagnosis.py stats    # each position-0 token's share of the inputs' x^2 per channel
    python experiments/qwen_sink_diagnosis.py drop0    # RTN hessian W4A16 with position 0 left out of the statistics
    python experiments/qwen_sink_diagnosis.py base     # the same without that change (the recovery protocol's row)

The model, calibration (32 x 512 C4 tokens) and evaluation (16 WikiText-2 windows of 1024) are
experiments/recovery_results.py's for ``qwen2.5-coder-0.5b``. ``drop0`` wraps ``InputStatistics.add`` so the
Linears' statistics skip the first token of every calibration window (a diagnosis, not a library option).
"""
from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq import statistics as S  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402

MODES = ("stats", "drop0", "base")
LAYERS = (".layers.0.", ".layers.3.", ".layers.12.", ".layers.23.")
PROJS = ("q_proj", "o_proj", "gate_proj", "down_proj")


def stats(lm, d) -> None:
    x = calibration_batches(lm.tokenizer, d.calib, 4, 512, seed=0, bos=d.calib_bos)
    seen = {}

    def hook(mod, args, out, n):
        a = args[0].detach().float()
        seen[n] = (a[:, 0].square().sum(0), a.square().sum((0, 1)), a.norm(dim=-1))

    hs = [m.register_forward_hook(lambda mod, args, out, n=n: hook(mod, args, out, n))
          for n, m in lm.model.named_modules() if n.endswith(PROJS) and any(k in n for k in LAYERS)]
    with torch.no_grad():
        lm.model(x)
    for h in hs:
        h.remove()
    for n, (first, total, norms) in seen.items():
        print(json.dumps({"linear": n, "position0_share": float(first.sum() / total.sum()),
                          "max_channel_position0_share": float((first / total).max()),
                          "position0_norm": float(norms[:, 0].mean()), "median_norm": float(norms[:, 1:].median()),
                          "max_other_norm": float(norms[:, 1:].max())}))


def main(argv=None) -> int:
    mode = (argv or sys.argv[1:] or ["stats"])[0]
    if mode not in MODES:
        raise SystemExit(f"mode {mode!r}: allowed values: {', '.join(MODES)}")
    spec = R.MODELS["qwen2.5-coder-0.5b"]
    if not Path(spec["path"]).exists():
        raise SystemExit(f"{spec['path']} is missing; make it with python experiments/fetch_qwen_gguf.py --model 0.5b")
    lm = R.load_model(spec["path"])
    d = R.default_texts(spec["path"])
    torch.manual_seed(0)
    if mode == "stats":
        stats(lm, d)
        return 0
    if mode == "drop0":
        add = S.InputStatistics.add
        S.InputStatistics.add = lambda self, x: add(self, x[:, 1:] if x.dim() == 3 else x)
    student = copy.deepcopy(lm.model)
    cfg = PTQConfig(activations="w4a16", n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                    skip_indivisible=spec["skip_indivisible"], method="rtn", scale_rule="hessian")
    t = time.time()
    calibrate_and_quantize(student, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
    print(json.dumps({"mode": mode, "ppl": R._ppl(student, lm, spec, d), "ptq_seconds": time.time() - t}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
