"""Streaming PTQ: quantize a model larger than memory, one decoder layer in memory at a time, resumable.

``quantize_streaming(source_dir, out_dir, config, calibration)`` builds the transformers model on the meta
device (``models.hf_streaming``), materializes the embeddings / final norm / head, then for each decoder
layer: loads its tensors from the checkpoint shards (memory-mapped ``safe_open`` reads of those keys only),
calibrates and quantizes it exactly as ``quantize_model`` does (``quantize_model.quantize_layer``, every
method and recipe, dense and MoE), computes its exported tensors (``export.layer_tensors``), writes them to
a part file in the work directory and releases the layer (back to the meta device; its small scales stay,
the checkpoint's config and report are made of them). At the end ``export_checkpoint`` runs on that
skeleton, the layers' tensors read back from the part files one output shard at a time
(``tensor_source``), inside export's ``atomic_directory``: the files are byte-identical to
``quantize_model`` + ``export_checkpoint`` on the fully loaded model (the report's ``created`` and
``seconds`` aside).

Peak memory: embeddings + head + at most two decoder layers (the float layer while its quantized modules
are built, and its exported copy) + the calibration activations (two sets while a layer runs), and one
output shard (``max_shard_size``) while assembling. ``offload_activations=DIR`` keeps the activations
between layers on disk and reads one batch at a time (the statistics / KV passes drop each batch's output,
the pass producing the next layer's inputs writes each batch to disk as it is computed).

Resume (``stream_state``): after each layer the work directory records it; ``resume=True`` restarts at the
first unfinished layer (refused when the config / format / source / calibration differ) and gives the
same bytes. The output directory appears only when complete; the work directory is removed on success.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ..errors import CheckpointError, UsageError
from ..export import export_checkpoint, format_named, layer_tensors
from ..export.destination import check_output
from ..export.writer import parse_size
from ..models.hf_streaming import StreamingModel, release, shard_files
from . import stream_skeleton
from .capture import LayerInput, decoder_layers, run_layer
from .config import PTQConfig
from .export_check import check_recipe_exportable
from .finite import check_finite_parameters
from .fused_experts import ExpertsReport
from .quantize_model import LinearReport, PTQReport, finish_pass, first_inputs, quantize_layer, start_pass
from ..file_errors import reading
from .stream_state import WorkDir, atomic_write, fingerprint, load_tensors, save_tensors, source_files, work_dir_for

SMALL = 4096  # FP32 tensors of at most this many elements stay real in a released layer (the scales the export
# reads: NVFP4 outer / input scales, FP8 per-tensor scales, KV scales; codes and block scales were checked per layer)
KILL_ENV = "BLOCKSCALE_STREAMING_KILL_AFTER"  # test hook: SIGKILL this process once layer N is recorded


def _trim() -> None:
    """Give the freed heap back to the system (glibc keeps a released layer's pages otherwise, and the RSS
    would grow by a fraction of a layer per layer)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _kept(_name: str, t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.numel() <= SMALL


class _Inputs(Sequence):
    """Calibration inputs whose hidden states are read from disk one batch at a time."""

    def __init__(self, files: list[Path], meta: list):
        self.files, self.meta = files, meta

    def __len__(self):
        return len(self.files)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[j] for j in range(*b.indices(len(self)))]
        args, kwargs = self.meta[b]
        return LayerInput(load_tensors(self.files[b])["hidden"], args, kwargs)


def _report_from(d: dict) -> PTQReport:
    d = dict(d)
    d["linears"] = [LinearReport(**{**x, "shape": tuple(x["shape"])}) for x in d.get("linears", [])]
    ex = []
    for x in d.get("experts", []):
        x = {k: v for k, v in x.items() if k in {f.name for f in fields(ExpertsReport)}}
        x["gate_up_shape"], x["down_shape"] = tuple(x["gate_up_shape"]), tuple(x["down_shape"])
        ex.append(ExpertsReport(**x))
    d["experts"] = ex
    return PTQReport(**{k: v for k, v in d.items() if k in {f.name for f in fields(PTQReport)}})


def _jsonable(obj):
    import json

    return json.loads(json.dumps(obj, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def quantize_streaming(source_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], config: PTQConfig,
                       calibration: Optional[torch.Tensor] = None, format: str = "compressed-tensors", *,
                       dtype: torch.dtype = torch.float32, device=None, tokenizer=None,
                       max_shard_size: Union[int, str] = "2GB", metadata=None, extra_files=None,
                       overwrite: bool = False, resume: bool = False,
                       offload_activations: Optional[Union[str, os.PathLike]] = None, progress: bool = True,
                       on_layer: Optional[Callable] = None) -> PTQReport:
    """Quantize the transformers model in ``source_dir`` (a local directory: config.json + safetensors
    shards) layer by layer and write its checkpoint to ``out_dir`` (see the module docstring).

    config / calibration / device: as ``quantize_model``; format / tokenizer / max_shard_size / overwrite:
    as ``export_checkpoint``; ``metadata`` / ``extra_files``: as ``export_checkpoint``, or a callable
    ``(report) -> value`` called once the layers are done. ``dtype``: the model dtype (as ``load_model``).
    ``resume``: continue the unfinished run recorded in the work directory ``.<out name>.streaming`` next to
    ``out_dir``. ``offload_activations``: a directory for the calibration activations between layers
    (created if missing; only our ``hidden-*`` files are written and removed there). ``on_layer(i, phase,
    model)``: called with phase "loaded" and "released" for each layer processed. Returns the PTQ report."""
    t0 = time.time()
    if not isinstance(config, PTQConfig):
        raise TypeError(f"config must be a PTQConfig, got {type(config).__name__}")
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise UsageError("streaming PTQ runs in one process; run it without torchrun (or a process group of "
                         "several ranks)")
    fmt = format_named(format)
    check_recipe_exportable(config.ptq_recipe, fmt.name)
    parse_size(max_shard_size)
    source = Path(source_dir).expanduser().absolute()
    shard_files(source)
    out = check_output(out_dir, overwrite, source)
    src = StreamingModel(source, dtype)
    model = src.model
    if getattr(model.config, "use_cache", None) is not None:  # as models.hf.load_model
        model.blockscale_use_cache = bool(model.config.use_cache)
        model.config.use_cache = False
    _generation_config(model, source)
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    work = WorkDir(work_dir_for(out))
    acts = check_offload_dir(offload_activations, source, out, work.path)
    run_device = torch.device(device) if device is not None else torch.device("cpu")
    previous = work.read_state() if resume and work.path.is_dir() and not work.path.is_symlink() else None
    files = source_files(source, (previous or {}).get("source_files"), progress)
    digest = fingerprint(config.to_dict(), fmt.name, dtype, run_device, source,
                         calibration if config.needs_calibration else None, files)
    state = work.open(digest, resume)
    if state is not None:
        work.check_state(state, len(layers), config.needs_calibration)
        acts = _resumed_offload(state, acts, offload_activations)
    src.load_outside(prefix)
    run = start_pass(model, config, calibration, device, check_finite=False, data_parallel=False)
    made_acts = bool(state.get("made_activations")) if state is not None else acts is not None and not acts.exists()
    if acts is not None:
        acts.mkdir(parents=True, exist_ok=True)
    act_dir = acts or work.path
    kept = {"digest": digest["digest"], "parts": digest, "source_files": files,
            "activations": str(acts) if acts is not None else None, "made_activations": made_acts}

    def hidden_files(i, n):
        return [act_dir / f"hidden-{i:05d}-{b:05d}.safetensors" for b in range(n)]

    def save_hidden(i, hidden_list):
        for f, h in zip(hidden_files(i, len(hidden_list)), hidden_list):
            save_tensors(f, {"hidden": h})

    records: dict = {}
    start = 0
    inputs = None
    meta = None
    if state is None:
        inputs = first_inputs(run, calibration)
        if inputs is not None:
            meta = [(x.args, x.kwargs) for x in inputs]
            atomic_write(work.inputs, lambda p: torch.save(meta, p))
            save_hidden(0, [x.hidden for x in inputs])
            if acts is not None:
                inputs = _Inputs(hidden_files(0, len(inputs)), meta)
        work.write_state({**kept, "done": 0, "report": _jsonable(run.report.to_dict()), "records": {},
                          "batches": len(meta) if meta is not None else 0})
    else:
        start, records = state["done"], state["records"]
        try:
            meta, inputs = _resume(run, state, work, src, layers, prefix, config, hidden_files(start, state["batches"]))
        except CheckpointError as e:
            raise CheckpointError(f"{e}; remove {work.path} to start over" if "start over" not in str(e) else str(e)) \
                from None
        if inputs is not None and acts is None:
            inputs = list(inputs)

    def advance(layer, xs, dev):
        if acts is None:
            return run_layer(layer, xs, dev)
        nxt = hidden_files(current + 1, len(xs))
        for b, x in enumerate(xs):
            save_tensors(nxt[b], {"hidden": run_layer(layer, [x], dev)[0].hidden})
        return _Inputs(nxt, meta)

    kill_after = os.environ.get(KILL_ENV)
    it = range(start, len(layers))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"PTQ {config.label} (streaming)", unit="layer", initial=start, total=len(layers))
    for current in it:
        path = f"{prefix}.{current}"
        src.load_module(path)
        check_finite_parameters(_Indexed(layers, current), prefix)
        run.method.check_layer(layers[current], path)  # (preflight.check_layers, this layer)
        if on_layer is not None:
            on_layer(current, "loaded", model)
        inputs = quantize_layer(run, current, inputs, advance)
        for mod in [*run.per_layer[current].values(), *dict(run.per_layer_experts[current]).values()]:
            release(mod)  # the float modules the plan refers to (replaced in the model, still loaded)
        save_tensors(work.part(current), layer_tensors(model, path, fmt.name))
        if inputs is not None and acts is None and current + 1 < len(layers):
            save_hidden(current + 1, [x.hidden for x in inputs])
        layer = layers[current]
        release(layer, _kept)
        rec, small = stream_skeleton.record(layer, _fresh_layer(src, layers, current), lambda *_: True)
        save_tensors(work.skeleton(current), small)
        records[str(current)] = rec
        work.write_state({**kept, "done": current + 1, "report": _jsonable(run.report.to_dict()),
                          "records": records, "batches": len(meta) if meta is not None else 0})
        for f in act_dir.glob(f"hidden-{current:05d}-*.safetensors"):
            f.unlink()
        _trim()
        if on_layer is not None:
            on_layer(current, "released", model)
        if kill_after is not None and int(kill_after) == current:
            os.kill(os.getpid(), signal.SIGKILL)
    report = finish_pass(run, t0)
    from safetensors import safe_open

    parts = {}
    for i in range(len(layers)):
        with reading(work.part(i), "streaming work file"), \
                safe_open(str(work.part(i)), framework="pt", device="cpu") as f:
            parts.update({k: work.part(i) for k in f.keys()})
    used = set()

    def tensor_source(name, placeholder):
        part = parts.get(name)
        if part is None:
            if placeholder.device.type == "meta":
                raise RuntimeError(f"streaming export: no part file holds {name}")
            return placeholder
        with reading(part, "streaming work file"), \
                safe_open(str(part), framework="pt", device="cpu") as f:  # (opened per tensor: nothing stays mapped)
            t = f.get_tensor(name)
        if t.shape != placeholder.shape or t.dtype != placeholder.dtype:
            raise RuntimeError(f"streaming export: {name} is {t.dtype} {tuple(t.shape)} in its part file but "
                               f"{placeholder.dtype} {tuple(placeholder.shape)} in the model")
        used.add(name)
        return t

    meta_arg = metadata(report) if callable(metadata) else metadata
    extra_arg = extra_files(report) if callable(extra_files) else extra_files
    export_checkpoint(model, out, fmt.name, tokenizer=tokenizer, max_shard_size=max_shard_size, metadata=meta_arg,
                      overwrite=overwrite, source=source, extra_files=extra_arg, tensor_source=tensor_source)
    if set(parts) - used:
        raise RuntimeError(f"streaming export: {len(set(parts) - used)} part tensor(s) were not written "
                           f"(e.g. {sorted(set(parts) - used)[0]})")
    src.close()
    work.remove()
    if acts is not None:
        for f in acts.glob("hidden-*-*.safetensors"):
            f.unlink()
        if made_acts and not any(acts.iterdir()):
            acts.rmdir()
    return report


class _Indexed(Sequence):
    """``layers`` up to layer i, the earlier ones empty (``check_finite_parameters`` names layer i by its index)."""

    def __init__(self, layers, i):
        self.layers, self.i = layers, i

    def __len__(self):
        return self.i + 1

    def __getitem__(self, j):
        return self.layers[j]

    def __iter__(self):
        for j in range(self.i + 1):
            yield _Empty() if j < self.i else self.layers[j]


class _Empty:
    def named_modules(self):
        return iter(())


def _fresh_layer(src: StreamingModel, layers, i: int):
    """Layer ``i`` as the model class builds it (meta), to compare module classes with."""
    from transformers.utils.generic import ContextManagers

    cache = getattr(src, "_fresh", None)
    if cache is None:
        with ContextManagers(type(src.model).get_init_context(src.dtype, False, False, None)):
            cache = src._fresh = type(src.model)(src.model.config)
    return decoder_layers(cache)[i]


def _resume(run, state, work, src, layers, prefix, config, hidden):
    """The finished layers rebuilt and the report restored from ``state``; returns (the batches' call
    arguments, the inputs of the first unfinished layer) or (None, None) without calibration. Every file
    read is checked (CheckpointError naming it)."""
    start = state["done"]
    with reading(work.path / "state.json", "streaming state"):
        run.report = _report_from(state["report"])
    for i in range(start):
        _rebuild(src, layers, prefix, i, state["records"][str(i)], work)
    if not (config.needs_calibration and start < len(layers)):
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
    return meta, _Inputs(hidden, meta)


def _rebuild(src, layers, prefix, i, rec, work) -> None:
    with reading(work.path / "state.json", f"streaming state (layer {i}'s record)"):
        stream_skeleton.rebuild(layers[i], rec, load_tensors(work.skeleton(i)))


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


def _resumed_offload(state: dict, acts: Optional[Path], given) -> Optional[Path]:
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


def _generation_config(model, source: Path) -> None:
    """generation_config.json of the source, as ``from_pretrained`` reads it."""
    if (source / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)


def check_streaming_source(model: str) -> Path:
    """``model`` as the local transformers safetensors directory ``--streaming`` needs (UsageError otherwise)."""
    p = Path(model).expanduser()
    if not p.is_dir():
        raise UsageError(f"--streaming: MODEL {model} must be a local Hugging Face model directory of safetensors "
                         "shards (config.json + model*.safetensors); built-in names, .gguf files and hub names are "
                         "not streamed: convert or download them first")
    shard_files(p)
    return p.absolute()


__all__ = ["KILL_ENV", "check_offload_dir", "check_streaming_source", "quantize_streaming"]
