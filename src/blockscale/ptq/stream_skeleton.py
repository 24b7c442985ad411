"""The skeleton of a finished decoder layer, so a resumed streaming run can rebuild it without its inputs.

After a layer is quantized, exported and released, what stays of it in the model is its module
structure (``NVFP4Linear`` / ``FP8Linear`` / ``MXLinear`` / quantized experts replacing the Linears, KV
scales on the attention modules), its small tensors (outer / input / KV scales: what the checkpoint's
config and report are made of) and meta-device placeholders for the rest. ``record`` writes that down
as JSON (class paths, plain attributes, tensor shapes / dtypes) plus a safetensors file of the small
tensors; ``rebuild`` puts it back into a freshly built meta layer. No pickle: only classes of blockscale,
torch.nn and transformers (nn.Module subclasses) are re-created, attributes are JSON values and dtypes.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError

_BASE = frozenset(nn.Module().__dict__) | {"_is_hf_initialized"}
_MODULES = ("blockscale.", "torch.nn.", "transformers.")


class NotRecordable(ValueError):
    """A module attribute the record cannot hold (the run then cannot be resumed past that layer)."""


def _enc(v: Any):
    if isinstance(v, nn.Module):  # not a submodule (e.g. the experts' ``_hf_shell``, used to run them): the
        return None  # skeleton is only exported, never run
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, (list, tuple)):
        return {"__tuple__" if isinstance(v, tuple) else "__list__": [_enc(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"__set__": sorted(_enc(x) for x in v)}
    raise NotRecordable(type(v).__name__)


def _dec(v: Any):
    if isinstance(v, dict):
        if "__dtype__" in v:
            return getattr(torch, v["__dtype__"])
        if "__tuple__" in v:
            return tuple(_dec(x) for x in v["__tuple__"])
        if "__list__" in v:
            return [_dec(x) for x in v["__list__"]]
        if "__set__" in v:
            return set(_dec(x) for x in v["__set__"])
    return v


def _class_path(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def record(layer: nn.Module, fresh: nn.Module, small) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON record, {tensor name: small real tensor}) of ``layer`` (released); ``fresh``: the same
    layer as the model built it (meta), to tell which modules were replaced; ``small(name, t)``: whether a
    real tensor is kept. NotRecordable when a replaced module holds an attribute JSON cannot hold."""
    fresh_mods = dict(fresh.named_modules())
    replaced, tensors, real = {}, {}, {}
    for name, m in layer.named_modules():
        f = fresh_mods.get(name)
        if f is None or type(f) is not type(m):
            attrs = {}
            for k, v in m.__dict__.items():
                if k in _BASE or k.startswith("_forward") or k.startswith("_backward"):
                    continue
                try:
                    attrs[k] = _enc(v)
                except NotRecordable as e:
                    raise NotRecordable(f"{name}.{k}: a {e} attribute") from None
            replaced[name] = {"class": _class_path(m), "attrs": attrs, "training": m.training,
                              "non_persistent": sorted(m._non_persistent_buffers_set)}
        own = {}
        for kind, store in (("param", m._parameters), ("buffer", m._buffers)):
            for leaf, t in store.items():
                if t is None:
                    own[leaf] = [kind, None, None, False]
                    continue
                full = f"{name}.{leaf}" if name else leaf
                own[leaf] = [kind, list(t.shape), str(t.dtype).removeprefix("torch."),
                             bool(t.requires_grad) if kind == "param" else False]
                if t.device.type != "meta":
                    real[full] = t.detach().to("cpu").contiguous().clone()
        tensors[name] = own
    return {"replaced": replaced, "tensors": tensors}, real


def _new(spec: dict) -> nn.Module:
    path = spec["class"]
    if not path.startswith(_MODULES):
        raise CheckpointError(f"streaming work directory: module class {path} is not one blockscale re-creates")
    mod_name, _, qual = path.rpartition(".")
    cls = getattr(importlib.import_module(mod_name), qual, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise CheckpointError(f"streaming work directory: {path} is not an nn.Module class")
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in spec["attrs"].items():
        m.__dict__[k] = _dec(v)
    m.training = spec["training"]
    m._non_persistent_buffers_set = set(spec["non_persistent"])
    return m


def rebuild(layer: nn.Module, rec: dict, real: dict[str, torch.Tensor]) -> None:
    """Put the recorded skeleton into ``layer`` (a freshly built meta layer), in place."""
    for name in sorted(rec["replaced"], key=lambda n: n.count(".") if n else -1):
        new = _new(rec["replaced"][name])
        if not name:
            raise CheckpointError("streaming work directory: a whole decoder layer was replaced; cannot rebuild it")
        parent, _, child = name.rpartition(".")
        (layer.get_submodule(parent) if parent else layer)._modules[child] = new
    for name, own in rec["tensors"].items():
        m = layer.get_submodule(name) if name else layer
        for leaf, (kind, shape, dtype, grad) in own.items():
            store = m._parameters if kind == "param" else m._buffers
            if shape is None:
                store[leaf] = None
                continue
            full = f"{name}.{leaf}" if name else leaf
            t = real.get(full)
            if t is None:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            store[leaf] = nn.Parameter(t, requires_grad=grad) if kind == "param" else t
        for leaf in [k for k in m._parameters if k not in own]:
            del m._parameters[leaf]
        for leaf in [k for k in m._buffers if k not in own]:
            del m._buffers[leaf]


__all__ = ["NotRecordable", "rebuild", "record"]
