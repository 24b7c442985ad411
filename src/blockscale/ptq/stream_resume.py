"""What a resumed streaming PTQ run (``ptq.streaming``) reads back from its work directory: the PTQ report
so far (kept in ``state.json`` as JSON), the finished layers' skeletons and the inputs of the first
unfinished layer. Every file read is checked (CheckpointError naming it)."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..file_errors import reading
from . import stream_skeleton
from .fused_experts import ExpertsReport
from .quantize_model import LinearReport, PTQReport
from .stream_activations import OffloadedInputs
from .stream_state import WorkDir, load_tensors


def report_json(report: PTQReport):
    """``report`` as the JSON value ``state.json`` keeps (tuples as lists, anything else unknown as str)."""
    return json.loads(json.dumps(report.to_dict(), default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def report_from(d: dict) -> PTQReport:
    """The PTQ report ``report_json`` kept."""
    d = dict(d)
    d["linears"] = [LinearReport(**{**x, "shape": tuple(x["shape"])}) for x in d.get("linears", [])]
    ex = []
    for x in d.get("experts", []):
        x = {k: v for k, v in x.items() if k in {f.name for f in fields(ExpertsReport)}}
        x["gate_up_shape"], x["down_shape"] = tuple(x["gate_up_shape"]), tuple(x["down_shape"])
        ex.append(ExpertsReport(**x))
    d["experts"] = ex
    return PTQReport(**{k: v for k, v in d.items() if k in {f.name for f in fields(PTQReport)}})


def restore(run, state: dict, work: WorkDir, layers, needs_calibration: bool, hidden: list[Path]):
    """The finished layers rebuilt and the report restored from ``state``; returns (the batches' call
    arguments, the inputs of the first unfinished layer) or (None, None) without calibration."""
    start = state["done"]
    with reading(work.path / "state.json", "streaming state"):
        run.report = report_from(state["report"])
    for i in range(start):
        record = state["records"][str(i)]
        with reading(work.path / "state.json", f"streaming state (layer {i}'s record)"):
            stream_skeleton.rebuild(layers[i], record, load_tensors(work.skeleton(i)))
    if not (needs_calibration and start < len(layers)):
        return None, None
    with reading(work.inputs, "streaming work file"):
        meta = torch.load(work.inputs, weights_only=True)
    if not isinstance(meta, list) or len(meta) != state["batches"]:
        raise CheckpointError(f"{work.inputs}: holds {type(meta).__name__} of "
                              f"{len(meta) if isinstance(meta, list) else '?'} batch(es), {state['batches']} recorded")
    from safetensors import safe_open

    for f in hidden:
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (the activations entering layer {start})")
        with reading(f, "streaming work file"), safe_open(str(f), framework="pt") as st:
            if list(st.keys()) != ["hidden"]:
                raise CheckpointError(f"{f}: holds {sorted(st.keys())[:3]}, not the tensor 'hidden'")
    return meta, OffloadedInputs(hidden, meta)


__all__ = ["report_from", "report_json", "restore"]
