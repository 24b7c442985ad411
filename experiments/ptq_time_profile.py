"""Where a PTQ start's time goes: seconds in AWQ's grid search (and, inside it, rounding the candidates' weights),
in the GPTQ loops, and the rest (calibration forwards, statistics, Hessians), printed every minute and at the end.

The start is quantized exactly as ``experiments/start_selection_results.py`` quantizes it (the recovery protocol's
calibration); the phases are timed by wrapping the library's functions in this process only.

    python experiments/ptq_time_profile.py --model smollm2-135m --start "AWQ + GPTQ hessian"
    timeout 600 python experiments/ptq_time_profile.py --model qwen2.5-coder-0.5b --start "AWQ + GPTQ hessian"

Reads only the model and texts of ``recovery_results.MODELS``; writes nothing.
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as R  # noqa: E402
import start_selection_results as S  # noqa: E402

from blockscale import lsq  # noqa: E402
from blockscale.ptq.methods import awq as awq_mod  # noqa: E402
from blockscale.ptq.methods import awq_error  # noqa: E402
from blockscale.ptq.methods.gptq import method as gptq_method  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def _timed(fn, label):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SECONDS[label] += time.perf_counter() - t
            CALLS[label] += 1
    return wrapper


def instrument() -> None:
    """Wrap AWQ's searches, the candidates' weight rounding inside them, and GPTQ's per-weight calls."""
    awq_mod.awq_search = _timed(awq_mod.awq_search, "AWQ grid search")
    awq_mod.awq_search_parts = _timed(awq_mod.awq_search_parts, "AWQ grid search")
    gptq_method.GPTQ.quantize_weight = _timed(gptq_method.GPTQ.quantize_weight, "GPTQ")
    gptq_method.GPTQ.quantize_weight_weighted = _timed(gptq_method.GPTQ.quantize_weight_weighted, "GPTQ")
    quantizers = awq_error.scheme_quantizers

    def scheme_quantizers(*a, **k):
        qw, aq = quantizers(*a, **k)
        return _timed(qw, "AWQ grid: rounding the candidates"), aq
    awq_error.scheme_quantizers = scheme_quantizers
    awq_mod.scheme_quantizers = scheme_quantizers


def _line(t0: float) -> str:
    return (f"[{time.time() - t0:.0f} s] " + ", ".join(f"{k} {v:.1f} s ({CALLS[k]} calls)"
                                                      for k, v in sorted(SECONDS.items())))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(R.MODELS))
    labels = [c.label for c in lsq.START_CANDIDATES + S.REFERENCES]
    ap.add_argument("--start", required=True, choices=labels)
    ap.add_argument("--activations", default="w4a16", choices=("w4a16", "w4a4"))
    args = ap.parse_args(argv)
    instrument()
    cand = next(c for c in lsq.START_CANDIDATES + S.REFERENCES if c.label == args.start)
    spec, lm, d = R.model_and_texts(args.model)
    t0 = time.time()

    def tick():
        while True:
            time.sleep(60)
            print(_line(t0), flush=True)
    threading.Thread(target=tick, daemon=True).start()
    student = copy.deepcopy(lm.model)
    calibrate_and_quantize(student, lm.tokenizer, cand.config(S.base_config(spec, args.activations)), d.calib,
                           d.calib_bos, progress=True)
    total = time.time() - t0
    print(_line(t0))
    inner = SECONDS["AWQ grid search"] + SECONDS["GPTQ"]
    print(f"total {total:.1f} s; outside AWQ's grid and GPTQ (calibration forwards, statistics, Hessians): "
          f"{total - inner:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
