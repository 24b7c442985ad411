"""``StreamingQuantizer``: streaming PTQ (``ptq.streaming``) as named steps over one run's state: the
constructor checks the arguments and builds the model skeleton, ``resume()`` opens the work directory,
``process_layer(i)`` quantizes and records one decoder layer, ``export()`` writes the checkpoint;
``run()`` does them in order."""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from ..errors import CheckpointError, UsageError
from ..export import export_checkpoint, format_named, layer_tensors
from ..export.destination import check_output
from ..export.writer import parse_size
from ..models.hf_streaming import StreamingModel, check_source, release, trim_heap
from . import stream_skeleton
from .capture import decoder_layers, run_layer
from .config import PTQConfig
from .export_check import check_recipe_exportable
from .finite import check_finite_parameters
from .quantize_model import PTQReport, finish_pass, first_inputs, quantize_layer, start_pass
from .stream_activations import OffloadedInputs, hidden_files, save_hidden
from .stream_checks import check_offload_dir, resumed_offload
from .stream_options import StreamingOptions
from .stream_parts import PartFiles
from .stream_resume import report_json, restore
from .stream_state import WorkDir, atomic_write, fingerprint, save_tensors, source_files, work_dir_for

SMALL = 4096  # FP32 tensors of at most this many elements stay real in a released layer (the scales the export
# reads: NVFP4 outer / input scales, FP8 per-tensor scales, KV scales; codes and block scales were checked per layer)


def _kept(_name: str, t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.numel() <= SMALL


class StreamingQuantizer:
    """One streaming PTQ run of the transformers model in ``source_dir`` (a local directory: config.json +
    safetensors shards; or a GGUF file of a streamable architecture) to the checkpoint ``out_dir`` (arguments: as ``quantize_streaming``). Call
    ``resume()``, then ``process_layer(i)`` for each layer from the index it returns, in order, then
    ``export()``; or ``run()``. The constructor raises for a wrong argument before anything is written."""

    def __init__(self, source_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], config: PTQConfig,
                 calibration: Optional[torch.Tensor] = None, format: str = "compressed-tensors",
                 options: StreamingOptions = StreamingOptions()):
        self.t0 = time.time()
        if not isinstance(config, PTQConfig):
            raise TypeError(f"config must be a PTQConfig, got {type(config).__name__}")
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise UsageError("streaming PTQ runs in one process; run it without torchrun (or a process group of "
                             "several ranks)")
        self.config, self.calibration, self.options = config, calibration, options
        self.fmt = format_named(format)
        check_recipe_exportable(config.ptq_recipe, self.fmt.name)
        parse_size(options.max_shard_size)
        self.source = Path(source_dir).expanduser().absolute()
        check_source(self.source)
        self.out = check_output(out_dir, options.overwrite, self.source)
        self.src = StreamingModel(self.source, options.dtype)
        self.model = self.src.model
        if getattr(self.model.config, "use_cache", None) is not None:  # as models.hf.load_model
            self.model.blockscale_use_cache = bool(self.model.config.use_cache)
            self.model.config.use_cache = False
        _generation_config(self.model, self.source)
        self.layers = decoder_layers(self.model)
        self.prefix = next(n for n, m in self.model.named_modules() if m is self.layers)
        self.work = WorkDir(work_dir_for(self.out))
        self.run_pass = self.inputs = self.meta = self.acts = None
        self.records: dict = {}
        self.kept: dict = {}

    @property
    def act_dir(self) -> Path:
        """Where the hidden states between layers are written: the activations directory or the work directory."""
        return self.acts or self.work.path

    def resume(self) -> int:
        """Open the work directory: with ``options.resume`` and a recorded run, check that it was made with
        the same config, format, dtype, device, source and calibration (UsageError naming what differs) and
        rebuild its finished layers; otherwise start a new one (UsageError over an unfinished run). Returns
        the first layer to process."""
        opts, config = self.options, self.config
        acts = check_offload_dir(opts.offload_activations, self.source, self.out, self.work.path)
        run_device = torch.device(opts.device) if opts.device is not None else torch.device("cpu")
        work = self.work
        previous = work.read_state() if opts.resume and work.path.is_dir() and not work.path.is_symlink() else None
        files = source_files(self.source, (previous or {}).get("source_files"), opts.progress)
        digest = fingerprint(config.to_dict(), self.fmt.name, opts.dtype, run_device, self.source,
                             self.calibration if config.needs_calibration else None, files)
        state = work.open(digest, opts.resume)
        if state is not None:
            work.check_state(state, len(self.layers), config.needs_calibration)
            acts = resumed_offload(state, acts, opts.offload_activations)
        self.src.load_outside(self.prefix)
        self.run_pass = start_pass(self.model, config, self.calibration, opts.device, check_finite=False,
                                   data_parallel=False)
        made_acts = bool(state.get("made_activations")) if state is not None else acts is not None and not acts.exists()
        if acts is not None:
            acts.mkdir(parents=True, exist_ok=True)
        self.acts = acts
        self.kept = {"digest": digest["digest"], "parts": digest, "source_files": files,
                     "activations": str(acts) if acts is not None else None, "made_activations": made_acts}
        if state is None:
            self._start()
            return 0
        self._restore(state)
        return state["done"]

    def _start(self) -> None:
        """A new run: the first layer's inputs captured and recorded, state.json with no layer done."""
        self.inputs = first_inputs(self.run_pass, self.calibration)
        if self.inputs is not None:
            self.meta = [(x.args, x.kwargs) for x in self.inputs]
            atomic_write(self.work.inputs, lambda p: torch.save(self.meta, p))
            save_hidden(self.act_dir, 0, [x.hidden for x in self.inputs])
            if self.acts is not None:
                self.inputs = OffloadedInputs(hidden_files(self.act_dir, 0, len(self.inputs)), self.meta)
        self._write_state(0)

    def _restore(self, state: dict) -> None:
        """A resumed run: the finished layers, the report and the next layer's inputs read back."""
        start, self.records = state["done"], state["records"]
        hidden = hidden_files(self.act_dir, start, state["batches"])
        try:
            self.meta, self.inputs = restore(self.run_pass, state, self.work, self.layers,
                                             self.config.needs_calibration, hidden)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; remove {self.work.path} to start over" if "start over" not in str(e)
                                  else str(e)) from None
        if self.inputs is not None and self.acts is None:
            self.inputs = list(self.inputs)

    def _write_state(self, done: int) -> None:
        self.work.write_state({**self.kept, "done": done, "report": report_json(self.run_pass.report),
                               "records": self.records, "batches": len(self.meta) if self.meta is not None else 0})

    def _advance(self, i: int):
        """``quantize_layer``'s ``advance`` for layer ``i``: with offloaded activations, each batch's output
        written to disk as it is computed."""
        if self.acts is None:
            return run_layer

        def advance(layer, xs, dev):
            nxt = hidden_files(self.act_dir, i + 1, len(xs))
            for b, x in enumerate(xs):
                save_tensors(nxt[b], {"hidden": run_layer(layer, [x], dev)[0].hidden})
            return OffloadedInputs(nxt, self.meta)
        return advance

    def process_layer(self, i: int) -> None:
        """Load decoder layer ``i``, check it, calibrate and quantize it, write its exported tensors, the
        next layer's inputs and its skeleton, record it in state.json and release it (``on_layer`` is
        called with "loaded" and "released")."""
        run, layers, path, on_layer = self.run_pass, self.layers, f"{self.prefix}.{i}", self.options.on_layer
        self.src.load_module(path)
        check_finite_parameters(_Indexed(layers, i), self.prefix)
        run.method.check_layer(layers[i], path)  # (preflight.check_layers, this layer)
        if on_layer is not None:
            on_layer(i, "loaded", self.model)
        self.inputs = quantize_layer(run, i, self.inputs, self._advance(i))
        for mod in [*run.per_layer[i].values(), *dict(run.per_layer_experts[i]).values()]:
            release(mod)  # the float modules the plan refers to (replaced in the model, still loaded)
        save_tensors(self.work.part(i), layer_tensors(self.model, path, self.fmt.name))
        if self.inputs is not None and self.acts is None and i + 1 < len(layers):
            save_hidden(self.act_dir, i + 1, [x.hidden for x in self.inputs])
        release(layers[i], _kept)
        rec, small = stream_skeleton.record(layers[i], _fresh_layer(self.src, layers, i), lambda *_: True)
        save_tensors(self.work.skeleton(i), small)
        self.records[str(i)] = rec
        self._write_state(i + 1)
        for f in self.act_dir.glob(f"hidden-{i:05d}-*.safetensors"):
            f.unlink()
        trim_heap()
        if on_layer is not None:
            on_layer(i, "released", self.model)

    def export(self) -> PTQReport:
        """Write the checkpoint from the skeleton and the part files (inside export's atomic directory),
        then remove the work directory and our activation files. Returns the PTQ report."""
        opts = self.options
        report = finish_pass(self.run_pass, self.t0)
        parts = PartFiles([self.work.part(i) for i in range(len(self.layers))])
        metadata = opts.metadata(report) if callable(opts.metadata) else opts.metadata
        extra = opts.extra_files(report) if callable(opts.extra_files) else opts.extra_files
        export_checkpoint(self.model, self.out, self.fmt.name, tokenizer=opts.tokenizer,
                          max_shard_size=opts.max_shard_size, metadata=metadata, overwrite=opts.overwrite,
                          source=self.source, extra_files=extra, tensor_source=parts)
        parts.check_all_written()
        self.src.close()
        self.work.remove()
        if self.acts is not None:
            for f in self.acts.glob("hidden-*-*.safetensors"):
                f.unlink()
            if self.kept["made_activations"] and not any(self.acts.iterdir()):
                self.acts.rmdir()
        return report

    def run(self) -> PTQReport:
        """``resume()``, ``process_layer`` for each unfinished layer (a progress bar with
        ``options.progress``), ``export()``."""
        start = self.resume()
        it = range(start, len(self.layers))
        if self.options.progress:
            from tqdm.auto import tqdm

            it = tqdm(it, desc=f"PTQ {self.config.label} (streaming)", unit="layer", initial=start,
                      total=len(self.layers))
        for i in it:
            self.process_layer(i)
        return self.export()


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


def _generation_config(model, source: Path) -> None:
    """generation_config.json of the source, as ``from_pretrained`` reads it."""
    if (source / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)


__all__ = ["SMALL", "StreamingQuantizer"]
