"""The paths a streaming PTQ run (``ptq.streaming``) is given, checked before anything is written: the
source model directory and the activations directory (``offload_activations``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, UsageError
from ..models.hf_streaming import check_source, is_gguf


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (both resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def check_offload_dir(offload, source: Path, out: Path, work: Path) -> Optional[Path]:
    """``--offload-activations`` as an absolute path: UsageError for an existing file, or a directory
    that is, or lies inside, the model read, the output directory or the streaming work directory (its
    files would land among the user's model files, or create the output before it is complete)."""
    if offload is None:
        return None
    acts = Path(offload).expanduser().absolute()
    if acts.exists() and not acts.is_dir():
        raise UsageError(f"offload_activations (--offload-activations) {offload}: exists and is not a directory; "
                         "give a directory (created if missing)")
    for where, what in ((source, "the model being read"), (out, "the output directory"),
                        (work, "the streaming work directory")):
        if _inside(acts, where) or _inside(where, acts):
            raise UsageError(f"offload_activations (--offload-activations) {offload}: must not be, lie inside or "
                             f"contain {what} ({where}); choose a directory of its own")
    return acts


def resumed_offload(state: dict, acts: Optional[Path], given) -> Optional[Path]:
    """The activations directory a resumed run uses: the recorded one; UsageError when another is given."""
    recorded = state.get("activations")
    recorded = Path(recorded) if isinstance(recorded, str) else None
    if given is not None and acts != recorded:
        raise UsageError(f"--resume: offload_activations (--offload-activations) {given}: the run was started with "
                         f"{'--offload-activations ' + str(recorded) if recorded else 'the activations in memory'}; "
                         "resume with the same value")
    if recorded is not None and not recorded.is_dir():
        raise CheckpointError(f"--resume: the run keeps its activations in {recorded}, which is gone; remove the "
                              "work directory to start over")
    return recorded


def check_streaming_source(model: str) -> Path:
    """``model`` as a source streaming reads: a local transformers safetensors directory or a GGUF file of a
    streamable architecture (UsageError otherwise)."""
    p = Path(model).expanduser()
    if not p.is_dir() and not is_gguf(p):
        raise UsageError(f"--streaming: MODEL {model} must be a local Hugging Face model directory of safetensors "
                         "shards (config.json + model*.safetensors) or a .gguf file")
    check_source(p)
    return p.absolute()


__all__ = ["check_offload_dir", "check_streaming_source", "resumed_offload"]
