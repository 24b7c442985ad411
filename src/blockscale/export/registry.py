"""The checkpoint-format registry: every checkpoint format (compressed-tensors, ModelOpt, ...) is one
module that builds one ``CheckpointFormat``, calls ``register`` and registers one ``codecs.TensorCodec``
per tensor kind it stores; ``export_checkpoint`` and ``load_checkpoint`` look the format up here and
its codecs in ``codecs``, and never test a format's name.

    register(CheckpointFormat(name="modelopt", quant_method="modelopt", quantization_config=..., ...))
    format_named("modelopt_fp4")   -> the CheckpointFormat (aliases accepted; UsageError otherwise)
    FORMATS                        -> read-only {name: CheckpointFormat}, in registration order

A format owns its config and its naming; how a Linear's tensors are stored is its codecs'. Contract
of the callables (``schemes``: {module name: ModuleScheme} of every quantized Linear, in model order;
``kv``: None (no KV-cache scales), "tensor" (one per attention layer) or "head" (one per KV head)):

    quantization_config(schemes, ignore, producer, blockscale, kv) -> config.json ``quantization_config``
      (the schemes grouped as the format groups them, each described by its codec's ``describe``)
    side_files(schemes, ignore, producer, kv) -> {file name: JSON object} written next to config.json
    check(schemes, kv) -> None: ValueError for a combination the format cannot hold (each scheme has a codec)
    unsupported(module, scheme) -> the refusal of a scheme no codec stores (None: a generic one)
    detects(quantization_config or None, has_file) -> bool: the directory holds this format
      (``has_file(name)``: a regular file ``name`` inside the directory)
    parse(quantization_config or None, side files {name: JSON object read}) -> ParsedConfig;
      ``schema.ConfigError`` (with ``.file``) naming the key of a malformed or unsupported field
    kv: ``KVScales`` naming / shaping the FP8 KV-cache scales (None: the format stores none)

The registry also plugs each format's ``detects`` into ``models.checkpoint_detection``, the one
detector ``models.hf`` (refusing to open a checkpoint through transformers) and ``load_checkpoint``
share; models sits below export, so export registers into it rather than models importing export.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import UsageError
from ..models.checkpoint_detection import register_detector, unregister_detector
from .codecs import unregister_codecs


@dataclass(frozen=True)
class ParsedConfig:
    """What a checkpoint's configs say, module by module: ``scheme_of(name)`` -> the ``ModuleScheme``
    of a Linear stored quantized (None: kept in high precision); ``kv``: None (no KV-cache scales),
    "tensor" (one k_scale / v_scale per attention layer) or "head" (one per KV head)."""

    scheme_of: Callable[[str], Any]
    kv: Optional[str] = None
    transforms: tuple = ()  # online input transforms (compressed-tensors ``ct_transforms.TransformGroup``s)


@dataclass(frozen=True)
class KVScales:
    """How a format stores FP8 KV-cache scales: names(attention module) -> (k tensor name, v tensor
    name); export(scale [1] or [H_kv], per_head) -> the tensor to write; shapes(kv, H_kv) -> allowed shapes."""

    names: Callable[[str], tuple]
    export: Callable[[torch.Tensor, bool], torch.Tensor]
    shapes: Callable[[str, int], tuple]


def _no_side_files(schemes: dict, ignore: list, producer: dict, kv: Optional[str]) -> dict[str, Any]:
    return {}


def _no_rule(schemes: dict, kv: Optional[str]) -> None:
    return None


@dataclass(frozen=True)
class CheckpointFormat:
    """One registered checkpoint format (see the module docstring for the callables' contract).

    name: what ``export_checkpoint(format=...)`` takes and ``checkpoint_format`` returns.
    quant_method: config.json ``quantization_config.quant_method`` it writes (named in messages).
    aliases: other names ``format=`` accepts (lower case).
    side_file_names: {file name: what it is, in words} of the JSON files it writes beside config.json
      and ``parse`` reads (when present).
    serving_dtype: config.json ``dtype`` to write (the dtype the format's runtime decompresses to);
      None: the model dtype.
    transforms(rotations {module: (group, Rotation)}, dtype, keys {attention module: (group, Rotation)}) ->
      ({quantization_config keys to set}, {tensor name: tensor}): how the format stores online input rotations and
      key rotations (R3) (None: it cannot; ``export_checkpoint`` refuses them).
    detection: how ``detects`` recognises it, in words (for the "not a checkpoint" message).
    """

    name: str
    quant_method: str
    quantization_config: Callable[[dict, list, dict, dict, Optional[str]], dict]
    detects: Callable[[Optional[dict], Callable[[str], bool]], bool]
    parse: Callable[[Optional[dict], Mapping[str, dict]], ParsedConfig]
    aliases: tuple[str, ...] = ()
    side_files: Callable[[dict, list, dict, Optional[str]], dict] = _no_side_files
    side_file_names: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[dict, Optional[str]], None] = _no_rule
    unsupported: Optional[Callable[[str, Any], str]] = None
    kv: Optional[KVScales] = None
    serving_dtype: Optional[torch.dtype] = None
    detection: str = ""
    transforms: Optional[Callable[[dict, torch.dtype, Optional[dict]], tuple[dict, dict]]] = None


_BY_NAME: dict[str, CheckpointFormat] = {}
_ALIASES: dict[str, str] = {}
FORMATS: Mapping[str, CheckpointFormat] = types.MappingProxyType(_BY_NAME)


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` (and its detector); ValueError if its name or an alias is taken by another format."""
    if not isinstance(fmt, CheckpointFormat):
        raise TypeError(f"register expects a blockscale.export.registry.CheckpointFormat, got {type(fmt).__name__}")
    for key in (fmt.name, *fmt.aliases):
        owner = _ALIASES.get(key.lower())
        if owner is not None and _BY_NAME[owner] is not fmt:
            raise ValueError(f"checkpoint format {fmt.name!r}: {key!r} is already registered by {owner!r}")
    _BY_NAME[fmt.name] = fmt
    for key in (fmt.name, *fmt.aliases):
        _ALIASES[key.lower()] = fmt.name
    register_detector(fmt.name, fmt.detects)
    return fmt


def unregister(name: str) -> None:
    """Remove the format registered as ``name`` (and its aliases, detector and codecs); nothing if absent."""
    fmt = _BY_NAME.pop(name, None)
    if fmt is None:
        return
    unregister_codecs(name)
    for key in [k for k, v in _ALIASES.items() if v == name]:
        del _ALIASES[key]
    unregister_detector(name)


def format_named(name: str) -> CheckpointFormat:
    """The format registered as ``name`` or one of its aliases (case-insensitive); UsageError (a
    ValueError) naming the supported formats otherwise."""
    key = str(name).strip().lower()
    if key not in _ALIASES:
        supported = ", ".join(f"{f.name!r}" + (f" (also {', '.join(map(repr, f.aliases))})" if f.aliases else "")
                              for f in _BY_NAME.values())
        raise UsageError(f"format={name!r}; supported: {supported}")
    return _BY_NAME[_ALIASES[key]]


def side_file_names() -> frozenset[str]:
    """Every side file some registered format writes (for ``destination.written_by_export``)."""
    return frozenset(n for f in _BY_NAME.values() for n in f.side_file_names)


__all__ = ["CheckpointFormat", "FORMATS", "KVScales", "ParsedConfig", "format_named", "register", "side_file_names",
           "unregister"]
