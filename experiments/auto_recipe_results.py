"""Automatic mixed precision under a bits budget (issue 34): perplexity against effective bits for the automatic
recipe (``ptq.auto_recipe``, both estimators), uniform NVFP4 W4A4, the built-in hand recipe and a random
assignment of the same budget; the protocol of docs/results/recovery.md (the same evaluation windows and
calibration text as experiments/recovery_results.py). Every cell uses PTQ's RTN with the default scale rule
(the estimators score RTN weights).

    python experiments/auto_recipe_results.py --out ~/.cache/blockscale/runs/auto-recipe            # resumable
    python experiments/auto_recipe_results.py --model moe-3m --out ~/.cache/blockscale/runs/auto-recipe-moe3m
    python experiments/auto_recipe_results.py --report-only DIR [DIR ...] > docs/results/auto-recipe.md

The sensitivities are measured once per estimator (their wall time is a row) and the solver runs per budget
(milliseconds). ``--budgets`` / ``--only`` restrict the grid, ``--max-minutes M`` stops starting new cells after M
minutes. Gap closed = (ppl_uniform - ppl) / (ppl_uniform - ppl_fp), uniform being NVFP4 W4A4 RTN (4.5 bits).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_results import MODELS, Results, _ppl  # noqa: E402
from rotation_results import _model  # noqa: E402  (spec, model, texts: moe-3m's own path and texts)

from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.auto_recipe import AutoRecipeConfig, auto_recipe, build_recipe, solve  # noqa: E402
from blockscale.ptq.auto_recipe.kv_cache import kv_choice  # noqa: E402
from blockscale.ptq.auto_recipe.costs import cost_table, effective_bits, unit_weights  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402
from blockscale.recipes import get_ptq_recipe  # noqa: E402
from blockscale.recipes.ptq_recipe import KVCacheScheme, PTQRecipe, Scheme  # noqa: E402
from blockscale.recipes.recipe import DEFAULT_EXCLUDE  # noqa: E402

BUDGETS = (5.0, 6.0, 8.5, 4.55)  # 5.0 first: the goal; 4.55: just above uniform NVFP4 (4.5 + outer scales)
HAND = "nvfp4-experts-fp8-attention"  # the built-in hand recipe (its FP8 KV cache left out: weights only)


def _random_choice(costs, budget, seed):
    """A random assignment within ``budget``: from every unit at its cheapest, five passes over the units in a seeded
    random order, each unit given a random candidate among those the remaining budget allows and at least as
    expensive as its current one (so the budget fills up)."""
    rng = random.Random(seed)
    choice = [min(range(len(row)), key=lambda c: row[c]) for row in costs]
    spent = sum(costs[u][c] for u, c in enumerate(choice))
    for _ in range(5):
        for u in rng.sample(range(len(costs)), len(costs)):
            base = spent - costs[u][choice[u]]
            ok = [c for c, v in enumerate(costs[u]) if v != float("inf") and base + v <= budget + 1e-9
                  and v >= costs[u][choice[u]]]
            choice[u] = rng.choice(ok)
            spent = base + costs[u][choice[u]]
    return choice


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, lm, d = _model(args.model)
    res = Results(out)
    ids = calibration_batches(lm.tokenizer, d.calib, spec["calib_samples"], spec["calib_seq_len"], seed=0,
                              bos=d.calib_bos)
    (out / "meta.json").write_text(json.dumps({"model": args.model, **spec, "calib": d.calib,
                                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "machine": platform.machine()}, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    common = dict(n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"], method="rtn",
                  skip_indivisible=spec["skip_indivisible"])
    t_start = time.time()
    scored: dict = {}

    def cell(key, recipe, extra):
        if res.get(key) is not None or (args.only and not any(o in key for o in args.only)):
            return
        if args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
            raise TimeoutError(key)
        model = __import__("copy").deepcopy(lm.model)
        t = time.time()
        calibrate_and_quantize(model, lm.tokenizer, PTQConfig(recipe=recipe, **common), d.calib, d.calib_bos,
                               progress=False)
        sec = time.time() - t
        res.add({"key": key, "ppl": _ppl(model, lm, spec, d), "ptq_seconds": round(sec, 1), **extra})

    def scores(estimator, cost):
        if (estimator, cost) not in scored:
            t = time.time()
            r = auto_recipe(lm.model, ids, AutoRecipeConfig(effective_bits=16.0, estimator=estimator, cost=cost,
                                                            n_samples=spec["calib_samples"],
                                                            seq_len=spec["calib_seq_len"], kv_cache_bits=16.0))
            scored[(estimator, cost)] = (r, time.time() - t)
            kv = dict(zip(r.kv.names, r.kv.scores))
            if res.get(f"search {estimator} {cost}") is None:
                res.add({"key": f"search {estimator} {cost}", "seconds": round(time.time() - t, 1),
                         "units": len(r.units), "tokens": r.sensitivity.tokens, "kv_scores": kv})
            elif res.get(f"kv scores {estimator} {cost}") is None:  # a search row from before the KV scores
                res.add({"key": f"kv scores {estimator} {cost}", "kv_scores": kv})
        return scored[(estimator, cost)][0]

    def solved(r, budget, cost):
        cands = r.config.candidates
        allowed = [[v is not None for v in row] for row in r.sensitivity.scores]
        w = unit_weights(r.units, r.sensitivity.active_fraction, cost)
        costs = cost_table(r.units, cands, w, allowed)
        sc = [[v if v is not None else 0.0 for v in row] for row in r.sensitivity.scores]
        return cands, costs, sc, w, allowed

    try:
        r = scores("fisher", "total")
        uniform = Scheme("nvfp4-w4a4")
        cell("uniform nvfp4-w4a4", PTQRecipe.single(uniform, ignore=DEFAULT_EXCLUDE),
             {"bits": effective_bits(r.units, [uniform] * len(r.units), unit_weights(r.units, None, "total")),
              "kind": "uniform"})
        for kv in ("fp8-e4m3", "nvfp4"):  # what each KV cache costs, alone and with uniform NVFP4 W4A4
            cell(f"fp + kv {kv}", PTQRecipe.single(Scheme("bf16")).replace(kv_cache=KVCacheScheme(kv)),
                 {"bits": 16.0, "kind": "kv", "kv": kv})
            cell(f"uniform nvfp4-w4a4 + kv {kv}", PTQRecipe.single(uniform).replace(kv_cache=KVCacheScheme(kv)),
                 {"bits": effective_bits(r.units, [uniform] * len(r.units), unit_weights(r.units, None, "total")),
                  "kind": "kv", "kv": kv})
        costs_cost = ("total", "active") if args.model == "moe-3m" else ("total",)
        for budget in args.budgets:
            for cost in costs_cost:
                for estimator, kv_bits in (("fisher", None), ("fisher-a4", None), ("output", None), ("fisher", 8.0),
                                           ("fisher", 4.5)):
                    key = f"auto {estimator} {cost} @{budget:g}" + (f" kv@{kv_bits:g}" if kv_bits else "")
                    if kv_bits and budget not in args.kv_budgets:
                        continue
                    if res.get(key) is not None or (args.only and not any(o in key for o in args.only)):
                        continue
                    r = scores(estimator.split("-")[0], cost)
                    cands, costs, sc, w, _ = solved(r, budget, cost)
                    if estimator.endswith("-a4"):  # activations quantized wherever the weights are: no W4A16
                        costs = [[float("inf") if s.name == "nvfp4-w4a16" else v for s, v in zip(cands, row)]
                                 for row in costs]
                    best = solve(sc, costs, budget)
                    chosen = [cands[c] for c in best.choice]
                    recipe = build_recipe(r.units, chosen, r.config, kv_cache=kv_choice(r.kv.names, r.kv.scores,
                                                                                          kv_bits).kv_cache
                                          if kv_bits else None)
                    counts = {k: effective_bits(r.units, chosen, unit_weights(r.units, r.sensitivity.active_fraction, k))
                              for k in ("total", "active")}
                    mix = {}
                    for s, u in zip(chosen, r.units):
                        mix[s.label] = mix.get(s.label, 0) + u.params
                    if args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
                        raise TimeoutError(key)
                    cell(key, recipe, {"bits": best.cost, "total_bits": counts["total"], "active_bits": counts["active"],
                                       "kind": "auto", "estimator": estimator, "cost": cost, "budget": budget,
                                       "objective": best.objective, "params_by_scheme": mix})
            key = f"random @{budget:g}"
            r = scores("fisher", "total")
            cands, costs, sc, w, _ = solved(r, budget, "total")
            choice = _random_choice(costs, budget, seed=int(budget * 100))
            chosen = [cands[c] for c in choice]
            cell(key, build_recipe(r.units, chosen, r.config),
                 {"bits": sum(costs[u][c] for u, c in enumerate(choice)), "kind": "random", "budget": budget,
                  "fisher_objective": sum(sc[u][c] for u, c in enumerate(choice))})
        hand = get_ptq_recipe(HAND).replace(kv_cache=None)
        r = scores("fisher", "total")
        from blockscale.ptq.scheme_plan import assign_schemes
        names = [u.members[0] for u in r.units]
        assigned = {n: assign_schemes(lm.model, [n], hand, set())[n] for n in names}
        hand_bits = effective_bits(r.units, [assigned[n] for n in names],
                                   unit_weights(r.units, r.sensitivity.active_fraction, "total"))
        cell(f"hand {HAND}", hand, {"bits": hand_bits, "kind": "hand"})
    except TimeoutError as e:
        print(f"stopping: --max-minutes {args.max_minutes} reached before {e}", flush=True)


def _closed(ppl, uni, fp):
    return 100.0 * (uni - ppl) / (uni - fp) if uni != fp else float("nan")


def _is_kv(row) -> bool:
    return row.get("kind") == "kv" or " kv@" in row["key"]


def _kv_table(res, fp) -> list[str]:
    """The KV cache rows: each next to the same weights without a KV cache (full precision, uniform NVFP4 W4A4,
    the automatic recipe at a budget)."""
    kv_rows = [r for r in res.rows if "ppl" in r and _is_kv(r)]
    if not kv_rows:
        return []
    out = ["", "KV cache (post-RoPE K and V fake-quantized with calibrated per-layer scales; the weights as in the "
           "row named): perplexity and what the KV cache adds to the same weights without it.", "",
           "| weights | KV cache | ppl | + ppl from the KV cache |", "|---|---|---:|---:|"]
    for r in kv_rows:
        if r.get("kind") == "kv":
            base_key, kv = r["key"].split(" + kv ")
            weights = "full precision" if base_key == "fp" else base_key
        else:
            base_key, b = r["key"].split(" kv@")
            kv, weights = {"8": "fp8-e4m3 (chosen within 8 bits)", "4.5": "nvfp4 (chosen within 4.5 bits)"}[b], base_key
        base = fp if base_key == "fp" else (res.get(base_key) or {}).get("ppl")
        delta = f"{r['ppl'] - base:+.4f}" if base is not None else "-"
        out.append(f"| {weights} | {kv} | {r['ppl']:.4f} | {delta} |")
    return out


def report(dirs, generated_by: str) -> str:
    lines = ["# Automatic mixed precision under a bits budget (issue 34)", "",
             f"Generated by `{generated_by}`. Every row: PTQ round to nearest (default scale rule) with the recipe; "
             "effective bits = stored bits per weight of the decoder Linears / experts, scales included "
             "(embeddings, lm_head and routers stay in high precision in every row and are not counted). Gap closed: "
             "against uniform NVFP4 W4A4 (4.5 bits), (ppl_uniform - ppl) / (ppl_uniform - ppl_fp).", ""]
    for out in dirs:
        out = Path(out)
        meta = json.loads((out / "meta.json").read_text())
        res = Results(out)
        fp, uni = res.get("fp")["ppl"], res.get("uniform nvfp4-w4a4")
        lines += [f"## {meta['model']}", "",
                  f"Evaluation: {meta['eval']}, {meta['eval_tokens']} tokens in windows of {meta['ctx']}; calibration "
                  f"(sensitivities and PTQ) {meta['calib_samples']} x {meta['calib_seq_len']} tokens of {meta['calib']}. "
                  f"Full precision: **{fp:.4f}**" + (f"; uniform NVFP4 W4A4: **{uni['ppl']:.4f}**." if uni else "."), "",
                  "| recipe | budget | effective bits | ppl | gap closed | schemes (parameters) | PTQ s |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        rows = [r for r in res.rows if "ppl" in r and r["key"] != "fp" and not _is_kv(r)]
        for r in sorted(rows, key=lambda r: (r.get("budget") or r.get("bits") or 0, r["key"])):
            closed = f"{_closed(r['ppl'], uni['ppl'], fp):.0f}%" if uni else "-"
            mix = ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in sorted(r.get("params_by_scheme", {}).items()))
            bits = "-" if r.get("bits") is None else f"{r['bits']:.3f}"
            extra = f" (total {r['total_bits']:.3f}, active {r['active_bits']:.3f})" if r.get("cost") == "active" else ""
            lines.append(f"| {r['key']} | {r.get('budget', '')} | {bits}{extra} | {r['ppl']:.4f} | {closed} | {mix} | "
                         f"{r.get('ptq_seconds', 0):.0f} |")
        lines += _kv_table(res, fp)
        searches = [r for r in res.rows if r["key"].startswith("search ")]
        if searches:
            lines += ["", "Search cost (sensitivities; the solver takes milliseconds): " + "; ".join(
                f"{r['key'][7:]}: {r['seconds']:.0f} s for {r['units']} units on {r['tokens']} tokens" for r in searches)
                      + "."]
        kv = [r for r in res.rows if "kv_scores" in r]
        if kv:
            lines += ["", "KV cache scores (the search's estimators, same units as the units' scores; bf16 0): " + "; ".join(
                f"{r['key'].split(' ', 2)[-1] if r['key'].startswith('kv') else r['key'][7:]}: "
                + ", ".join(f"{n} {v:.3e}" for n, v in r["kv_scores"].items() if n != "bf16") for r in kv) + "."]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path.home() / ".cache/blockscale/runs/auto-recipe"))
    ap.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "moe-3m"))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    ap.add_argument("--kv-budgets", nargs="+", type=float, default=[5.0],
                    help="weight budgets that also get the automatic recipe with a KV cache (kv@8: FP8, kv@4.5: NVFP4)")
    ap.add_argument("--only", nargs="+", help="run only cells whose key contains one of these")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes", metavar="FILE")
    ap.add_argument("--generated-by", default="python experiments/auto_recipe_results.py --report-only DIR ...")
    args = ap.parse_args(argv)
    if args.report_only:
        text = report(args.report_only, args.generated_by)
        if args.notes:
            text += "\n" + Path(args.notes).read_text()
        print(text)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
