"""The format registry: every block format registers one ``Format``, and everything that needs to know
a format (dispatch, QuantizedTensor, layout checks, recipes and their YAML, wire codecs, reports)
looks it up here instead of testing spec types one by one.

    register(Format(name="nvfp4", spec_type=NVFP4, quantize=..., dequantize=..., layout=..., ...))
    format_of(NVFP4())        -> the Format (TypeError naming the registered spec types otherwise)
    format_named("nvfp4")     -> the Format (ValueError naming the registered names otherwise)

A format is one sub-package of ``blockscale.quant`` whose ``__init__`` calls ``register``; importing
``blockscale.quant`` imports each of them. This module imports nothing from them (no circle).

Contract of the callables (x is already checked: a contiguous float32 / bfloat16 / float16 tensor,
finite unless the caller opted out):

    quantize(x, spec, generator, outputs, encode_scale) -> QuantizedTensor        outputs == "codes"
                                                        -> FP32 values             outputs == "values"
                                                        -> (QuantizedTensor, FP32 values)  "both"
        encode_scale is None unless ``accepts_encode_scale`` (a fixed FP32 outer scale).
    dequantize(q, dtype) -> tensor of q.shape in ``dtype`` (layout already checked)
    layout(spec, shape) -> {"codes": (shape, dtype), "scales": (shape, dtype)} that quantize stores
    check_extra(q) -> None: ValueError unless q's format-specific fields (``fields``) fit q.shape
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class Format:
    """One registered block format.

    name: the recipe / YAML name (``{format: name, ...}``) and the label in reports.
    spec_type: its frozen spec dataclass (the building block of recipes).
    block_size: elements per scale along the blocked dim, as a function of a spec (FP8 per-tensor: 0).
    blocked_dim: the dim blocks run along, as a function of a spec (-1 for most formats; MX: spec.dim).
    scale_rows: rows of a 2-D tensor (blocked along its last dim) that one row of its scales covers, as a
      function of a spec: 1 for per-row blocks (the default), 128 for FP8 128x128 tiles, 0 when the scales
      have no row dim (FP8 per tensor). ``QuantizedTensor.rows`` slices by it.
    fields: the optional QuantizedTensor fields it fills beyond codes / scales
      (e.g. ("outer_scale", "amax") for NVFP4, ("signs",) for S2F6).
    accepts_encode_scale: quantize takes a caller-given FP32 outer encode scale.
    blocks_along_any_dim: the spec has an int field ``dim`` choosing the blocked dim
      (``dataclasses.replace(spec, dim=d)`` blocks along d; MX), so callers may quantize along
      another dim instead of transposing first.
    description: one line for tables and ``blockscale formats``.
    """

    name: str
    spec_type: type
    quantize: Callable[..., Any]
    dequantize: Callable[[Any, torch.dtype], torch.Tensor]
    layout: Callable[[Any, tuple], dict]
    block_size: Callable[[Any], int]
    blocked_dim: Callable[[Any], int] = lambda spec: -1
    scale_rows: Callable[[Any], int] = lambda spec: 1
    check_extra: Optional[Callable[[Any], None]] = None
    fields: tuple[str, ...] = ()
    accepts_encode_scale: bool = False
    blocks_along_any_dim: bool = False
    description: str = ""


_BY_NAME: dict[str, Format] = {}
_BY_TYPE: dict[type, Format] = {}


def register(fmt: Format) -> Format:
    """Add ``fmt``; ValueError if its name or spec type is taken by another format."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register expects a blockscale.quant.registry.Format, got {type(fmt).__name__}")
    for table, key in ((_BY_NAME, fmt.name), (_BY_TYPE, fmt.spec_type)):
        if key in table and table[key] is not fmt:
            raise ValueError(f"format {fmt.name!r}: {key!r} is already registered by format {table[key].name!r}")
    _BY_NAME[fmt.name] = fmt
    _BY_TYPE[fmt.spec_type] = fmt
    return fmt


def unregister(name: str) -> Format:
    """Remove and return the format registered as ``name`` (e.g. a test's temporary format)."""
    fmt = format_named(name)
    del _BY_NAME[fmt.name], _BY_TYPE[fmt.spec_type]
    return fmt


def formats() -> tuple[Format, ...]:
    """Every registered format, in registration order."""
    return tuple(_BY_NAME.values())


def spec_types() -> tuple[type, ...]:
    """The registered spec dataclasses (what ``isinstance(spec, spec_types())`` accepts)."""
    return tuple(_BY_TYPE)


def _type_names() -> str:
    return ", ".join(f"blockscale.{t.__name__}" for t in _BY_TYPE)


def is_spec(spec) -> bool:
    """True if ``spec`` is an instance of a registered spec type."""
    return type(spec) in _BY_TYPE


def format_of(spec, name: str = "spec") -> Format:
    """The Format of ``spec``; TypeError naming ``name`` and the registered spec types otherwise."""
    fmt = _BY_TYPE.get(type(spec))
    if fmt is None:
        raise TypeError(f"{name} must be one of {_type_names()}, got {type(spec).__name__}")
    return fmt


def format_named(name: str) -> Format:
    """The Format registered as ``name``; ValueError naming the registered names otherwise."""
    fmt = _BY_NAME.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"format={name!r} is not a registered format; allowed values: "
                         f"{', '.join(map(repr, _BY_NAME))}")
    return fmt


__all__ = ["Format", "format_named", "format_of", "formats", "is_spec", "register", "spec_types", "unregister"]
