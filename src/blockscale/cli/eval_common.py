"""What ``blockscale eval tasks`` and ``blockscale eval zero-shot`` share: the model and its full-precision baseline
(``--baseline MODEL|auto``), the ``--json`` report, a markdown table, percentages."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..file_errors import write_text_atomic
from .checks import check_model, check_run_dir
from .common import parse_dtype

BASELINE_HELP = ("the full-precision model to compare with (a built-in name, a .gguf file, a transformers directory "
                 "or a hub name): its scores and the recovery (score / its score) per task; auto: the model a "
                 "blockscale checkpoint was made from, when that is a built-in model")


def resolve_baseline(value: Optional[str], model: str) -> Optional[str]:
    """The baseline model of ``--baseline`` (None without it); ``auto``: the built-in model the checkpoint
    ``model`` was made from (its recorded metadata), else a UsageError."""
    if value is None:
        return None
    if value != "auto":
        check_model(value, "--baseline")
        return value
    from ..models.hf import BUILTIN_MODELS, is_blockscale_checkpoint, source_model

    path = Path(model).expanduser()
    source = source_model(path) if path.is_dir() and is_blockscale_checkpoint(path) else None
    if source is None or source.lower() not in BUILTIN_MODELS:
        what = (f"the checkpoint was made from {source!r}, not a built-in model" if source is not None
                else f"{model} is not a blockscale checkpoint recording a built-in source model")
        raise UsageError(f"--baseline auto: {what}; name the full-precision model (--baseline NAME|DIR)")
    return source.lower()


def check_json(value: Optional[str]) -> None:
    """``--json FILE``: a file name in a directory we can write."""
    if value is None:
        return
    if Path(value).is_dir():
        raise UsageError(f"--json {value}: is a directory; give a file name")
    check_run_dir(Path(value).absolute().parent, "--json")


def write_json(path: Optional[str], report: dict) -> None:
    if path:
        write_text_atomic(path, json.dumps(report, indent=2, default=str))
        print(f"report: {path}")


def write_report(path: Optional[str], report: dict, baseline_name: Optional[str], result, baseline, recovery) -> None:
    """``report`` (with the baseline's results and ``recovery(result, baseline)`` when there is a baseline) as
    JSON to ``path`` (--json; nothing without it)."""
    if baseline is not None:
        report["baseline"] = {"model": baseline_name, **baseline.as_dict()}
        report["recovery"] = recovery(result, baseline)
    write_json(path, report)


def open_for_eval(name: str, args):
    """``ptq.pipeline.open_model`` with the --dtype / --device / --no-verify flags: a checkpoint of either format
    through ``blockscale.load``, any other model through ``models.hf.load_model``."""
    from ..ptq.pipeline import open_model

    print(f"loading {name} ...", flush=True)
    return open_model(name, dtype=parse_dtype(args.dtype or "float32"), device=args.device or "cpu",
                      verify=not args.no_verify)


def percent(x: Optional[float]) -> str:
    return "" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def number_cell(x: Optional[float]) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def markdown_table(header: list, rows: list) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def split_names(value: str, flag: str) -> list:
    """A comma-separated list flag's names (UsageError when it names none)."""
    names = [t.strip() for t in str(value).split(",") if t.strip()]
    if not names:
        raise UsageError(f"{flag} {value!r}: name at least one task (comma-separated)")
    return list(dict.fromkeys(names))


__all__ = ["BASELINE_HELP", "check_json", "markdown_table", "number_cell", "open_for_eval", "percent",
           "resolve_baseline", "split_names", "write_json"]
