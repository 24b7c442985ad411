"""lm-evaluation-harness (``pip install blockscale[eval]``) on a model in memory, or on a checkpoint through its
vLLM backend.

    res = evaluate_tasks(model, tokenizer.hf, ["hellaswag"], limit=100)      # lm_eval's HFLM wraps the model
    res.metrics["hellaswag"]["acc_norm"]
    task_recovery(res, evaluate_tasks(full_precision, tokenizer.hf, ["hellaswag"], limit=100))
    res = evaluate_tasks_vllm("ckpt/", ["hellaswag"])                          # vLLM loads the checkpoint

``evaluate_tasks`` hands ``lm_eval.simple_evaluate`` an ``HFLM`` around the very model object given (a
``blockscale.load``-ed checkpoint, a quantized model, a full-precision one): what is scored is blockscale's
numerics, fake-quantized activations included. ``evaluate_tasks_vllm`` passes a checkpoint directory (or a hub
name) to lm-eval's vLLM backend: vLLM's kernels, on a GPU.

Tasks are lm-eval task names; ``include_path`` adds a directory of task YAML files (offline tasks: ``dataset_path:
json`` with ``dataset_kwargs: {data_files: ...}``, docs/evaluation.md). When every task is found there, lm-eval's
own few thousand task files are not indexed (seconds saved). lm-eval seeds Python's, NumPy's and torch's random
generators: their states are put back afterwards.
"""
from __future__ import annotations

import logging
import math
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Optional, Sequence

import torch

INSTALL_HINT = "pip install blockscale[eval]"
VLLM_HINT = "pip install vllm (Linux with a CUDA GPU)"


def import_lm_eval():
    """The ``lm_eval`` module; ImportError (one line naming ``INSTALL_HINT``) when it is not installed."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager  # noqa: F401  (the parts used here import)
    except ImportError as exc:
        raise ImportError(f"lm-evaluation-harness (lm_eval) is not installed or does not import ({exc}): "
                          f"{INSTALL_HINT}") from None
    return lm_eval


def require_vllm() -> None:
    """ImportError (one line) when vLLM is not installed."""
    if find_spec("vllm") is None:
        raise ImportError(f"the vLLM backend needs vLLM, which is not installed: {VLLM_HINT}; or evaluate the "
                          "model in memory (the default backend)")


def task_manager(tasks: Sequence[str], include_path: Optional[str] = None):
    """An ``lm_eval`` TaskManager knowing every one of ``tasks`` (names or glob patterns): ``include_path``'s
    tasks alone when they cover them, else with lm-eval's built-in ones. ValueError naming the unknown ones."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if _unknown(local, tasks) == []:
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    bad = _unknown(manager, tasks)
    if bad:
        where = f" in {include_path} or" if include_path is not None else ""
        raise ValueError(f"unknown task(s) {', '.join(bad)}: not found{where} among lm-eval's tasks (`lm-eval ls "
                         "tasks` lists them; a local task needs its YAML in the include path)")
    return manager


def _unknown(manager, tasks: Sequence[str]) -> list:
    return [t for t in tasks if not manager.match_tasks([t])]


@dataclass
class TaskResults:
    """metrics: {task: {metric: value}} (a metric with a filter other than "none" keeps it: "exact_match,
    strict-match"; standard errors left out); higher_is_better: {task: {metric name: bool}}; items: {task: how
    many documents were scored}; groups: {group: {metric: value}} for task groups."""

    metrics: dict
    higher_is_better: dict = field(default_factory=dict)
    items: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"metrics": self.metrics, "higher_is_better": self.higher_is_better, "items": self.items,
                "groups": self.groups}


def _metrics(entry: dict) -> dict:
    out = {}
    for key, value in entry.items():
        name, _, filt = key.partition(",")
        if not filt or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name if filt == "none" else key] = float(value)
    return out


def parse_results(raw: dict) -> TaskResults:
    """``TaskResults`` from what ``lm_eval.simple_evaluate`` returned."""
    groups = set(raw.get("groups") or {})
    metrics = {t: _metrics(e) for t, e in (raw.get("results") or {}).items() if t not in groups}
    items = {t: int(n.get("effective", n.get("original", 0))) for t, n in (raw.get("n-samples") or {}).items()}
    hib = {t: {m: bool(v) for m, v in (h or {}).items()} for t, h in (raw.get("higher_is_better") or {}).items()}
    return TaskResults(metrics, hib, items, {g: _metrics(e) for g, e in (raw.get("groups") or {}).items()})


@contextmanager
def _quiet_and_seeded(debug: bool):
    """lm-eval's INFO / WARNING lines silenced (unless ``debug``); the random generators' states restored."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    if not debug:
        logger.setLevel(logging.ERROR)
    py, np_state = random.getstate(), None
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover -- numpy is a dependency
        np = None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        logger.setLevel(level)
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)


def _run(model, tasks, manager, *, num_fewshot, limit, batch_size, debug, model_args=None) -> TaskResults:
    from lm_eval import simple_evaluate

    with _quiet_and_seeded(debug):
        raw = simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), num_fewshot=num_fewshot,
                              limit=limit, batch_size=batch_size, task_manager=manager, log_samples=False,
                              bootstrap_iters=0)
    if raw is None:  # (a non-zero rank of a distributed lm-eval run)
        return TaskResults({})
    return parse_results(raw)


def evaluate_tasks(model, tokenizer, tasks: Sequence[str], *, num_fewshot: Optional[int] = None,
                   limit: Optional[int] = None, batch_size: int = 1, include_path: Optional[str] = None,
                   max_length: Optional[int] = None, manager=None, debug: bool = False) -> TaskResults:
    """lm-eval's ``tasks`` on ``model`` (a transformers causal LM, quantized or not: scored as it computes) with
    ``tokenizer`` (a transformers tokenizer). ``limit``: the first N documents per task; ``manager``: a
    ``task_manager(tasks, include_path)`` made already."""
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    if tokenizer is None:
        raise ValueError("lm-eval needs a transformers tokenizer for this model (save one next to its weights)")
    manager = manager if manager is not None else task_manager(tasks, include_path)
    with _quiet_and_seeded(debug):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    return _run(lm, tasks, manager, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, debug=debug)


def vllm_model_args(pretrained: str, *, dtype: str = "auto", tokenizer: Optional[str] = None,
                    max_length: Optional[int] = None, extra: Optional[dict] = None) -> dict:
    """lm-eval's ``model_args`` for its vLLM backend: the checkpoint directory or hub name, its dtype, its
    tokenizer (default: the checkpoint's own), no remote code; ``max_length`` as vLLM's max_model_len; ``extra``
    (e.g. ``tensor_parallel_size``, ``gpu_memory_utilization``) added last."""
    args = {"pretrained": str(pretrained), "tokenizer": str(tokenizer or pretrained), "dtype": dtype,
            "trust_remote_code": False}
    if max_length is not None:
        args["max_model_len"] = int(max_length)
    args.update(extra or {})
    return args


def evaluate_tasks_vllm(pretrained: str, tasks: Sequence[str], *, num_fewshot: Optional[int] = None,
                        limit: Optional[int] = None, batch_size="auto", include_path: Optional[str] = None,
                        model_args: Optional[dict] = None, manager=None, debug: bool = False) -> TaskResults:
    """lm-eval's ``tasks`` on the checkpoint ``pretrained`` served by vLLM (``model_args``: default
    ``vllm_model_args(pretrained)``). ImportError without vLLM."""
    import_lm_eval()
    require_vllm()
    manager = manager if manager is not None else task_manager(tasks, include_path)
    return _run("vllm", tasks, manager, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, debug=debug,
                model_args=model_args or vllm_model_args(pretrained))


def task_recovery(result: TaskResults, baseline: TaskResults) -> dict:
    """{task: {metric: recovery}} for the metrics both have: value / baseline where higher is better, baseline /
    value where lower is (perplexities); NaN where the denominator is 0."""
    out = {}
    for task, metrics in result.metrics.items():
        base = baseline.metrics.get(task, {})
        hib = {**baseline.higher_is_better.get(task, {}), **result.higher_is_better.get(task, {})}
        rec = {}
        for metric, value in metrics.items():
            if metric not in base:
                continue
            num, den = (value, base[metric]) if hib.get(metric.partition(",")[0], True) else (base[metric], value)
            rec[metric] = num / den if den not in (0, 0.0) and not math.isnan(den) else float("nan")
        out[task] = rec
    return out


__all__ = ["INSTALL_HINT", "TaskResults", "VLLM_HINT", "evaluate_tasks", "evaluate_tasks_vllm", "import_lm_eval",
           "parse_results", "require_vllm", "task_manager", "task_recovery", "vllm_model_args"]
