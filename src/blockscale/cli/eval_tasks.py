"""``blockscale eval tasks MODEL_OR_DIR --tasks T1,T2``: lm-evaluation-harness tasks (``eval.harness``;
``pip install blockscale[eval]``) on the model as blockscale computes it (lm-eval's HFLM around the loaded model
object: W4A4 fake-quantized activations included), or with ``--backend vllm`` on the checkpoint directory served
by vLLM; the recovery against a full-precision baseline per task and metric."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .checks import MAX_BATCH, MAX_SEQ_LEN, check_device, check_model, number
from .common import add_common, setup
from .eval_common import (BASELINE_HELP, check_json, markdown_table, number_cell, open_for_eval, percent,
                          resolve_baseline, split_names, write_report)

BACKENDS = ("hf", "vllm")
MAX_DOCS = 1 << 30


def parse_vllm_args(value) -> dict:
    """``--vllm-args KEY=VALUE,...`` as a dict (true / false, integers and floats converted)."""
    out = {}
    for part in [p for p in str(value or "").split(",") if p.strip()]:
        key, eq, raw = part.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--vllm-args {value!r}: expected KEY=VALUE[,KEY=VALUE...], got {part!r}")
        raw = raw.strip()
        conv = {"true": True, "false": False}.get(raw.lower())
        if conv is None:
            for kind in (int, float):
                try:
                    conv = kind(raw)
                    break
                except ValueError:
                    continue
        out[key.strip()] = raw if conv is None else conv
    return out


def _check_vllm_model(name: str, flag: str) -> None:
    from ..models.hf import BUILTIN_MODELS

    if name.lower() in BUILTIN_MODELS or name.lower() == "smollm2" or Path(name).suffix == ".gguf" or (
            Path(name).exists() and not Path(name).is_dir()):
        raise UsageError(f"{flag} {name}: --backend vllm takes a checkpoint directory or a hub name (export a "
                         "built-in model first: blockscale quantize)")


def _check(args):
    """Every flag before any model loads: (tasks, baseline, task manager). lm-eval (and vLLM for --backend vllm)
    must import."""
    from ..eval.harness import import_lm_eval, require_vllm, task_manager

    setup(args)
    check_model(args.model)
    tasks = split_names(args.tasks, "--tasks")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise UsageError(f"--include-path {args.include_path}: not a directory")
    baseline = resolve_baseline(args.baseline, args.model)
    check_json(args.json)
    args.vllm_extra = parse_vllm_args(args.vllm_args)
    if args.backend == "vllm":
        if args.device is not None:
            raise UsageError("--device: vLLM places the model itself; leave --device out with --backend vllm")
        for name, flag in ((args.model, "MODEL"), (baseline, "--baseline")):
            if name is not None:
                _check_vllm_model(name, flag)
    else:
        if args.vllm_extra:
            raise UsageError("--vllm-args needs --backend vllm")
        if args.dtype == "auto":
            raise UsageError("--dtype auto needs --backend vllm (the model is loaded here: float32, bfloat16 or "
                             "float16)")
        check_device(args.device)
    import_lm_eval()
    if args.backend == "vllm":
        require_vllm()
    try:
        manager = task_manager(tasks, args.include_path)
    except ValueError as exc:
        raise UsageError(f"--tasks {args.tasks}: {exc}") from None
    return tasks, baseline, manager


def _evaluate(name: str, args, tasks, manager):
    from ..eval.harness import evaluate_tasks, evaluate_tasks_vllm, vllm_model_args

    common = dict(num_fewshot=args.num_fewshot, limit=args.limit, manager=manager, debug=getattr(args, "debug", False))
    if args.backend == "vllm":
        print(f"evaluating {name} with vLLM ...", flush=True)
        model_args = vllm_model_args(name, dtype=args.dtype or "auto", max_length=args.max_length,
                                     extra=args.vllm_extra)
        return evaluate_tasks_vllm(name, tasks, batch_size=args.batch_size or "auto", model_args=model_args, **common)
    lm = open_for_eval(name, args)
    tokenizer = getattr(lm.tokenizer, "hf", None)
    if tokenizer is None:
        raise UsageError(f"{name}: lm-eval needs a transformers tokenizer and this model has none (save one next "
                         "to its weights)")
    print(f"evaluating {name} ...", flush=True)
    return evaluate_tasks(lm.model, tokenizer, tasks, batch_size=args.batch_size or 4, max_length=args.max_length,
                          **common)


def task_rows(result, baseline=None) -> list:
    from ..eval import task_recovery

    rec = task_recovery(result, baseline) if baseline is not None else {}
    rows = []
    for task, metrics in result.metrics.items():
        for metric, value in metrics.items():
            row = [task, metric, result.items.get(task, ""), number_cell(value)]
            if baseline is not None:
                row += [number_cell(baseline.metrics.get(task, {}).get(metric)),
                        percent(rec.get(task, {}).get(metric))]
            rows.append(row)
    return rows


def cmd_eval_tasks(args) -> int:
    from ..eval import task_recovery

    tasks, baseline_name, manager = _check(args)
    result = _evaluate(args.model, args, tasks, manager)
    baseline = _evaluate(baseline_name, args, tasks, manager) if baseline_name is not None else None
    print(f"\n{args.model}: lm-evaluation-harness, {'vLLM' if args.backend == 'vllm' else 'blockscale numerics'}"
          f"{f', {args.num_fewshot}-shot' if args.num_fewshot is not None else ''}"
          f"{f'; baseline {baseline_name}' if baseline is not None else ''}")
    header = ["task", "metric", "items", "value"] + (["baseline", "recovery"] if baseline is not None else [])
    print(markdown_table(header, task_rows(result, baseline)))
    report = {"model": args.model, "backend": args.backend, "tasks": tasks, "num_fewshot": args.num_fewshot,
              "limit": args.limit, **result.as_dict()}
    write_report(args.json, report, baseline_name, result, baseline, task_recovery)
    return 0


def add_eval_tasks(esub) -> None:
    t = esub.add_parser("tasks", help="lm-evaluation-harness tasks on the model as blockscale computes it (or vLLM); "
                                      "needs blockscale[eval]",
                        description="lm-evaluation-harness tasks (pip install blockscale[eval]) on a model: lm-eval's "
                                    "HFLM wraps the model blockscale loaded (a checkpoint of either format, a "
                                    "full-precision model), so its exact numerics are evaluated, W4A4 activations "
                                    "included; --backend vllm hands the checkpoint directory to vLLM instead. Local "
                                    "tasks: YAML files in --include-path (docs/evaluation.md).")
    t.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a checkpoint directory | a hub name")
    t.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (or glob patterns)")
    number(t, "--num-fewshot", int, lo=0, hi=1 << 10, help="few-shot examples per prompt (default: the task's)")
    number(t, "--limit", int, lo=1, hi=MAX_DOCS, help="the first N documents of each task (default: all)")
    number(t, "--batch-size", int, lo=1, hi=MAX_BATCH, help="sequences per forward pass (default 4; vLLM: auto)")
    t.add_argument("--include-path", metavar="DIR", help="a directory of task YAML files (offline tasks)")
    t.add_argument("--baseline", metavar="MODEL|auto", help=BASELINE_HELP)
    t.add_argument("--backend", default="hf", choices=BACKENDS,
                   help="hf: lm-eval's HFLM around the model loaded here (blockscale's numerics); vllm: vLLM loads the "
                        "checkpoint directory (a GPU; vLLM's kernels)")
    number(t, "--max-length", int, lo=2, hi=MAX_SEQ_LEN,
           help="longest sequence (default: the model's max_position_embeddings; vLLM: max_model_len)")
    t.add_argument("--vllm-args", metavar="KEY=VALUE,...",
                   help="more vLLM arguments for lm-eval's vLLM backend (e.g. tensor_parallel_size=2,"
                        "gpu_memory_utilization=0.8)")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"),
                   help="model dtype (default: float32; vLLM: auto)")
    t.add_argument("--device", help="device the model is loaded on (default: cpu; not with --backend vllm)")
    t.add_argument("--no-verify", action="store_true",
                   help="skip the content digests of a blockscale checkpoint (values are still checked)")
    t.add_argument("--json", help="also write the result as JSON to this file")
    add_common(t)
    t.set_defaults(func=cmd_eval_tasks)


__all__ = ["BACKENDS", "add_eval_tasks", "cmd_eval_tasks", "parse_vllm_args", "task_rows"]
