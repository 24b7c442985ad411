"""``blockscale eval zero-shot MODEL_OR_DIR``: blockscale's own zero-shot suite (``eval.zero_shot``: last word and next
sentence on held-out TinyStories / WikiText-2; ours, not a standard benchmark), with the recovery against a
full-precision baseline."""
from __future__ import annotations

from ..errors import UsageError
from .checks import MAX_BATCH, check_device, check_model, number
from .common import add_common, setup
from .eval_common import (BASELINE_HELP, check_json, markdown_table, number_cell, open_for_eval, percent,
                          resolve_baseline, split_names, write_report)

PROG = "blockscale eval zero-shot"
MAX_ITEMS = 1 << 20


def zero_shot_rows(result, baseline=None) -> list:
    """Table rows: task, items, acc, acc_norm (and the baseline's acc, recovery of acc)."""
    from ..eval import zero_shot_recovery

    rec = zero_shot_recovery(result, baseline) if baseline is not None else {}
    rows = []
    for task, r in result.tasks.items():
        row = [task, r.items, number_cell(r.acc), number_cell(r.acc_norm)]
        if baseline is not None:
            b = baseline.tasks.get(task)
            row += [number_cell(b.acc if b is not None else None), percent(rec.get(task))]
        rows.append(row)
    return rows


def zero_shot_table(result, baseline=None) -> str:
    header = ["task", "items", "acc", "acc_norm"] + (["baseline acc", "recovery"] if baseline is not None else [])
    return markdown_table(header, zero_shot_rows(result, baseline))


def _check(args):
    """Every flag, before a model loads: (tasks, baseline)."""
    from ..eval.zero_shot_suite import check_tasks

    setup(args)
    check_model(args.model)
    check_device(args.device)
    check_json(args.json)
    try:
        tasks = check_tasks(split_names(args.tasks, "--tasks")) if args.tasks else None
    except ValueError as exc:
        raise UsageError(f"--tasks {args.tasks}: {exc}") from None
    return tasks, resolve_baseline(args.baseline, args.model)


def _evaluate(name: str, args, tasks):
    from ..eval import ZERO_SHOT_TASKS, zero_shot
    from ..ptq.pipeline import default_texts

    lm = open_for_eval(name, args)
    if lm.tokenizer is None:
        raise UsageError(f"{name}: no tokenizer to encode the items with (save one next to the weights)")
    bos = default_texts(name).bos != "none"  # BOS opens every sequence where the model's perplexity has one
    return zero_shot(lm.model, lm.tokenizer, tasks or ZERO_SHOT_TASKS, args.limit, bos=bos,
                     batch_size=args.batch_size, log=lambda line: print(f"  {line}", flush=True))


def cmd_eval_zero_shot(args) -> int:
    tasks, baseline_name = _check(args)
    result = _evaluate(args.model, args, tasks)
    baseline = _evaluate(baseline_name, args, tasks) if baseline_name is not None else None
    print(f"\n{args.model}: blockscale's zero-shot suite (ours, not a standard benchmark; items from held-out "
          f"TinyStories / WikiText-2 text){f'; baseline {baseline_name}' if baseline else ''}")
    print(zero_shot_table(result, baseline))
    report = {"model": args.model, **result.as_dict()}
    from ..eval import zero_shot_recovery

    write_report(args.json, report, baseline_name, result, baseline, zero_shot_recovery)
    return 0


def add_eval_zero_shot(esub) -> None:
    from ..eval import DEFAULT_ITEMS, ZERO_SHOT_TASKS

    z = esub.add_parser("zero-shot", help="blockscale's own zero-shot suite (last word, next sentence on held-out "
                                          "text; not a standard benchmark): accuracy per task",
                        description="Accuracy on blockscale's own small zero-shot suite (not a standard benchmark): "
                                    "last-word prediction on held-out TinyStories and WikiText-2 passages (greedy, "
                                    "exact match) and the true next sentence among four (log-likelihood; acc and "
                                    "acc_norm), items chosen deterministically from the shared data folder. With "
                                    "--baseline: the full-precision model's accuracy and the recovery. "
                                    "docs/evaluation.md.")
    z.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a checkpoint directory | a hub name")
    z.add_argument("--tasks", help=f"comma-separated tasks (default: all: {', '.join(ZERO_SHOT_TASKS)})")
    number(z, "--limit", int, lo=1, hi=MAX_ITEMS,
           help=f"items per task: the first N of the fixed order (default {DEFAULT_ITEMS})")
    z.add_argument("--baseline", metavar="MODEL|auto", help=BASELINE_HELP)
    number(z, "--batch-size", int, lo=1, hi=MAX_BATCH, default=8, help="sequences per forward pass")
    z.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    z.add_argument("--device", default="cpu")
    z.add_argument("--no-verify", action="store_true",
                   help="skip the content digests of a blockscale checkpoint (values are still checked)")
    z.add_argument("--json", help="also write the result as JSON to this file")
    add_common(z)
    z.set_defaults(func=cmd_eval_zero_shot)


__all__ = ["add_eval_zero_shot", "cmd_eval_zero_shot", "zero_shot_rows", "zero_shot_table"]
