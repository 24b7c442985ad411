"""The checkpoint-format registry: every checkpoint format (compressed-tensors, ModelOpt, ...) is one
module that builds one ``CheckpointFormat`` and calls ``register``; ``export_checkpoint`` and
``load_checkpoint`` look the format up here and never test a format's name.

    register(CheckpointFormat(name="modelopt", quant_method="modelopt", tensor_names={...}, ...))
    format_named("modelopt_fp4")   -> the CheckpointFormat (aliases accepted; UsageError otherwise)
    FORMATS                        -> read-only {name: CheckpointFormat}, in registration order

A format describes one NVFP4 Linear ``<m>`` on disk. In memory (``NVFP4Linear``) it is
``weight_packed`` uint8 [N, K/2], ``weight_scale`` E4M3 [N, K/16], ``weight_global_scale`` = the FP32
encode scale S [1] (x^ = q * s / S) and, for W4A4, ``input_global_scale`` = S_in [1]. Contract of the
callables (``tensor_names`` maps those four buffer names to the format's on-disk suffixes):

    quantization_config(w4a4, ignore, producer, blockscale) -> config.json ``quantization_config``
    side_files(w4a4, ignore, producer) -> {file name: JSON object} written next to config.json
    export_tensor(buffer, t) -> (on-disk suffix, tensor to write)        (buffer in ``tensor_names``)
    check_module(name, m) -> None: ValueError when ``m`` (an NVFP4Linear) cannot be stored bit for bit
    detects(quantization_config or None, has_file) -> bool: the directory holds this format
      (``has_file(name)``: a regular file ``name`` inside the directory)
    parse_config(quantization_config or None, side files {name: JSON object read}) -> QuantScheme;
      ``schema.ConfigError`` (with ``.file``) naming the key of a malformed or unsupported field
    expected_tensors(in_features, out_features, w4a4) -> {suffix: (dtype, allowed shapes)}
    read_layer({suffix: tensor}) -> LayerTensors; ValueError for an unusable stored scale
    decode_scale(stored outer scale) -> the FP32 factor dequantization multiplies by, fl(1/S)

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


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization config says: W4A4 (NVFP4 activations) or W4A16, and which
    Linears are NVFP4 (``is_target`` and not ``is_ignored``)."""

    w4a4: bool
    is_ignored: Callable[[str], bool]
    is_target: Callable[[str], bool]

    def quantizes(self, name: str) -> bool:
        return self.is_target(name) and not self.is_ignored(name)


@dataclass(frozen=True)
class LayerTensors:
    """One NVFP4 Linear's fields read back from a checkpoint, as ``NVFP4Linear`` holds them: packed
    codes, E4M3 block scales, the FP32 encode scale S [1] and (W4A4) S_in [1]."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    input_global_scale: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class ParsedConfig:
    """What a checkpoint's configs say, module by module: ``scheme_of(name)`` -> the ``ModuleScheme``
    of a Linear stored quantized (None: kept in high precision); ``kv``: None (no KV-cache scales),
    "tensor" (one k_scale / v_scale per attention layer) or "head" (one per KV head)."""

    scheme_of: Callable[[str], Any]
    kv: Optional[str] = None


@dataclass(frozen=True)
class MixedFormat:
    """How a format stores FP8 / MX Linears, several schemes in one checkpoint and FP8 KV-cache
    scales (``CheckpointFormat.mixed``; a format without it holds all-NVFP4 checkpoints only).

    check(schemes {module: ModuleScheme}, kv None | "tensor" | "head") -> None; ValueError naming the
      module and scheme the format cannot store
    quantization_config(schemes, ignore, producer, blockscale, kv) -> config.json quantization_config
    side_files(schemes, ignore, producer, kv) -> {file name: JSON object}
    module_tensors(scheme, out_features, in_features) -> {suffix: (dtype, allowed shapes)} (FP8 / MX)
    export_module(scheme, {buffer: tensor}) -> {suffix: tensor}; read_module(scheme, {suffix: tensor})
      -> {buffer: tensor} (FP8 / MX; NVFP4 modules use the format's NVFP4 callables)
    kv_names(attention module name) -> (k tensor name, v tensor name)
    kv_export(scale [1] or [H_kv], per_head) -> tensor to write; kv_shapes(kv, H_kv) -> allowed shapes
    parse(quantization_config or None, side files) -> ParsedConfig; ``schema.ConfigError`` naming the key
    """

    check: Callable[[dict, Optional[str]], None]
    quantization_config: Callable[[dict, list, dict, dict, Optional[str]], dict]
    side_files: Callable[[dict, list, dict, Optional[str]], dict]
    module_tensors: Callable[[Any, int, int], dict]
    export_module: Callable[[Any, dict], dict]
    read_module: Callable[[Any, dict], dict]
    kv_names: Callable[[str], tuple]
    kv_export: Callable[[torch.Tensor, bool], torch.Tensor]
    kv_shapes: Callable[[str, int], tuple]
    parse: Callable[[Optional[dict], Mapping[str, dict]], ParsedConfig]


def _no_side_files(w4a4: bool, ignore: list[str], producer: dict) -> dict[str, Any]:
    return {}


def _no_check(name: str, module) -> None:
    return None


BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


@dataclass(frozen=True)
class CheckpointFormat:
    """One registered checkpoint format (see the module docstring for the callables' contract).

    name: what ``export_checkpoint(format=...)`` takes and ``checkpoint_format`` returns.
    quant_method: config.json ``quantization_config.quant_method`` it writes (named in messages).
    aliases: other names ``format=`` accepts (lower case).
    tensor_names: NVFP4Linear buffer -> on-disk suffix, for the four ``BUFFERS``.
    side_file_names: {file name: what it is, in words} of the JSON files it writes beside config.json
      and ``parse_config`` reads (when present).
    serving_dtype: config.json ``dtype`` to write (the dtype the format's runtime decompresses to);
      None: the model dtype.
    detection: how ``detects`` recognises it, in words (for the "not a checkpoint" message).
    mixed: FP8 / MX Linears, mixed schemes and KV-cache scales (``MixedFormat``); None: NVFP4 only.
    """

    name: str
    quant_method: str
    tensor_names: Mapping[str, str]
    quantization_config: Callable[[bool, list, dict, dict], dict]
    export_tensor: Callable[[str, torch.Tensor], tuple]
    detects: Callable[[Optional[dict], Callable[[str], bool]], bool]
    parse_config: Callable[[Optional[dict], Mapping[str, dict]], QuantScheme]
    expected_tensors: Callable[[int, int, bool], dict]
    read_layer: Callable[[dict], LayerTensors]
    decode_scale: Callable[[torch.Tensor], torch.Tensor]
    aliases: tuple[str, ...] = ()
    side_files: Callable[[bool, list, dict], dict] = _no_side_files
    side_file_names: Mapping[str, str] = field(default_factory=dict)
    check_module: Callable[[str, Any], None] = _no_check
    serving_dtype: Optional[torch.dtype] = None
    detection: str = ""
    mixed: Optional[MixedFormat] = None

    def suffix(self, buffer: str) -> str:
        """The on-disk suffix of an NVFP4Linear buffer."""
        return self.tensor_names[buffer]


_BY_NAME: dict[str, CheckpointFormat] = {}
_ALIASES: dict[str, str] = {}
FORMATS: Mapping[str, CheckpointFormat] = types.MappingProxyType(_BY_NAME)


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` (and its detector); ValueError if its name or an alias is taken by another format."""
    if not isinstance(fmt, CheckpointFormat):
        raise TypeError(f"register expects a blockscale.export.registry.CheckpointFormat, got {type(fmt).__name__}")
    if set(fmt.tensor_names) != set(BUFFERS):
        raise ValueError(f"checkpoint format {fmt.name!r}: tensor_names must map exactly {', '.join(BUFFERS)}")
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
    """Remove the format registered as ``name`` (and its aliases and detector); nothing if absent."""
    fmt = _BY_NAME.pop(name, None)
    if fmt is None:
        return
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


__all__ = ["BUFFERS", "CheckpointFormat", "FORMATS", "LayerTensors", "MixedFormat", "ParsedConfig", "QuantScheme",
           "format_named", "register", "side_file_names", "unregister"]
