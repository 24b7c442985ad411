"""Quantization on load, one decoder layer at a time: ``LayerLoader`` receives the full-precision tensors of
the modules PTQ will replace as transformers' loading engine reads them, puts them into the model (built on the
meta device), and as soon as a decoder layer holds all its tensors quantizes it with PTQ's own layer step
(``ptq.quantize_model.quantize_layer``, RTN without calibration) and releases the full-precision modules.

So the model is the one ``bs.quantize_model(model, config)`` makes from the loaded full-precision model, bit
for bit (the same plan, fused-group scales, modules and checks: ``start_pass`` on the meta model, then per layer
``check_finite_parameters``, the method's ``check_layer`` and ``quantize_layer``), while no more than one decoder
layer is held in full precision: transformers reads a checkpoint in sorted key order (``model.layers.0.*``,
then ``model.layers.1.*``, ...), so a layer is complete before the next one starts. A layer that is not complete
when loading ends (a tensor missing from the checkpoint, which transformers initializes afterwards, or a
non-persistent buffer still on the meta device) is quantized by ``finish`` instead.

Errors raised while quantizing inside transformers' loading would be turned into a generic conversion report;
the first one is kept and raised by ``finish`` as it is (a ``QuantizationError`` naming the module, ...).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.hf_streaming import release, trim_heap
from ..ptq.config import PTQConfig
from ..ptq.finite import check_finite_parameters
from ..ptq.quantize_model import PTQReport, finish_pass, quantize_layer, start_pass


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _mark_initialized(module: nn.Module) -> None:
    """transformers' ``_init_weights`` skips modules (and tensors) flagged ``_is_hf_initialized``: a quantized
    module's codes and scales are never re-initialized."""
    for m in module.modules():
        m._is_hf_initialized = True
        for t in _tensors(m):
            t._is_hf_initialized = True


class LayerLoader:
    """The per-layer quantization of one ``from_pretrained`` call (``model`` on the meta device, ``config`` the
    ``BlockscaleConfig.ptq_config``). ``wants(name)``: whether the tensor ``name`` (a model state-dict key) is
    one of those the quantizer takes (every parameter of the Linears and fused-experts modules PTQ replaces);
    ``put(name, tensor)`` takes it; ``finish()`` quantizes what is left and returns the PTQ report.
    ``held_layers`` (a diagnostic): the decoder layers whose planned modules hold full-precision tensors now."""

    def __init__(self, model: nn.Module, config: PTQConfig):
        self.t0 = time.time()
        self.model = model
        with torch.device("cpu"):  # (transformers builds the model, and calls us, under a meta device context)
            self.run = start_pass(model, config, None, check_finite=False, data_parallel=False)
        self.layer_of: dict[str, int] = {}
        for i, planned in enumerate(self.modules_of_layers()):
            for name, module in planned.items():
                for pname, _ in module.named_parameters():
                    self.layer_of[f"{name}.{pname}"] = i
        self.waiting = [0] * len(self.run.layers)
        for i in self.layer_of.values():
            self.waiting[i] += 1
        self.done = [False] * len(self.run.layers)
        self.error: Optional[BaseException] = None
        self.report: Optional[PTQReport] = None

    def modules_of_layers(self) -> list[dict[str, nn.Module]]:
        """Per decoder layer: the full-precision modules PTQ replaces in it (Linears, fused experts), by name."""
        return [{**linears, **experts} for linears, experts in zip(self.run.per_layer, self.run.per_layer_experts)]

    def wants(self, name: str) -> bool:
        return name in self.layer_of

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Set ``tensor`` as the parameter ``name`` (cast to the model's dtype for it, as transformers casts the
        tensors it sets) and quantize every decoder layer that is then complete (the tensors transformers sets
        itself, norms and the like, arrive between these calls). After a failure, tensors are dropped (the
        error is raised by ``finish``)."""
        if self.error is not None:
            return
        try:
            self._set(name, tensor)
            self.waiting[self.layer_of[name]] -= 1
            self._quantize_ready()  # (also a layer whose own last tensor, say a norm, came after its planned ones)
        except Exception as exc:  # noqa: BLE001  (kept and raised by finish, outside transformers' loading)
            self.error = exc

    def _set(self, name: str, tensor: torch.Tensor) -> None:
        path, _, pname = name.rpartition(".")
        module = self.model.get_submodule(path)
        ref = getattr(module, pname)
        if tuple(tensor.shape) != tuple(ref.shape):
            raise CheckpointError(f"{name}: shape {list(tensor.shape)} in the checkpoint, the model expects "
                                  f"{list(ref.shape)}")
        if tensor.is_floating_point() and tensor.dtype != ref.dtype:
            tensor = tensor.to(ref.dtype)
        param = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
        param._is_hf_initialized = True
        setattr(module, pname, param)

    def _complete(self, i: int) -> bool:
        """Whether decoder layer ``i`` holds every tensor: its planned modules' and its own (norms, biases, ...)."""
        return self.waiting[i] == 0 and all(t.device.type != "meta" for t in _tensors(self.run.layers[i]))

    def _quantize_ready(self) -> None:
        for i, done in enumerate(self.done):
            if not done and self._complete(i):
                self._quantize(i)

    def _quantize(self, i: int) -> None:
        """PTQ's checks and layer step on decoder layer ``i`` (where its tensors are), then its full-precision
        modules released to the meta device."""
        run, layer = self.run, self.run.layers[i]
        check_finite_parameters([nn.Module()] * i + [layer], run.prefix)  # (names the layer by its index)
        run.method.check_layer(layer, f"{run.prefix}.{i}")
        device = next((t.device for t in _tensors(layer)), torch.device("cpu"))
        run.home = run.device = device
        quantize_layer(run, i, None)
        for name, old in self.modules_of_layers()[i].items():
            new = self.model.get_submodule(name)
            if new is not old:  # replaced by its quantized module (what PTQ keeps stays as it is)
                release(old)
                _mark_initialized(new)
        self.done[i] = True
        trim_heap()

    def held_layers(self) -> list[int]:
        """The decoder layers whose planned (full-precision) modules hold real tensors now."""
        return [i for i, planned in enumerate(self.modules_of_layers())
                if any(t.device.type != "meta" for m in planned.values() for t in _tensors(m))]

    def finish(self) -> PTQReport:
        """Raise the first error kept while loading; otherwise quantize every layer not yet quantized (its
        missing tensors now initialized by transformers) and return the PTQ report."""
        if self.error is not None:
            raise self.error
        for i, done in enumerate(self.done):
            if not done:
                self._quantize(i)
        self.report = finish_pass(self.run, self.t0)
        return self.report


__all__ = ["LayerLoader"]
