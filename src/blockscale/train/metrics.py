"""Run metrics: the JSONL file a training run appends one row to per logged step, and its loss plot."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from ..file_errors import write_text_atomic, writing


def read_metrics(path: Union[str, Path]) -> list[dict]:
    """The JSON objects of a metrics file, skipping a torn last line."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines with step <= ``step`` (lines logged after the checkpoint we resume from)."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def plot_losses(metrics_paths: dict, out_png: Union[str, Path], title: Optional[str] = None,
                x: str = "step") -> Path:
    """Plot train (solid) and val (dashed, markers) loss of one or more runs in one PNG.

    metrics_paths: {label: metrics.jsonl path}; x: "step" or "tokens". Uses the Agg canvas directly
    (no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in ("step", "tokens"):
        raise ValueError(f"x={x!r}: expected 'step' or 'tokens'")
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, path) in enumerate(metrics_paths.items()):
        rows = read_metrics(path)
        color = f"C{i % 10}"
        tr = [(r[x], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        va = [(r[x], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if tr:
            ax.plot(*zip(*tr), color=color, alpha=0.8, label=f"{label} train")
        if va:
            ax.plot(*zip(*va), color=color, linestyle="--", marker="o", markersize=3, label=f"{label} val")
    ax.set_xlabel(x)
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with writing(out_png):
        fig.savefig(out_png)
    return out_png


def append_metrics(path: Path, row: dict) -> None:
    """Append one JSON row to the metrics file."""
    with writing(path), open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def plot_run(png: Path, metrics_path: Path, label: str, title: Optional[str] = None) -> Optional[Path]:
    """``png`` of one run's metrics (``plot_losses``); None without matplotlib or metrics."""
    if not metrics_path.exists():
        return None
    try:
        return Path(plot_losses({label: metrics_path}, png, title=title))
    except ImportError:
        return None


__all__ = ["append_metrics", "plot_losses", "plot_run", "read_metrics", "truncate_metrics"]
