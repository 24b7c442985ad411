"""The one table of quantization schemes: what one Linear's weights and inputs become, as data.

A ``SchemeRow`` is a preset name (``nvfp4-w4a4``, ``fp8-block``, ``mxfp4-w4a16``, ...), the format family
of its weights (a registered format's name, or "none"), its options (each with its allowed values, the
first the default), and functions of the chosen options: the weight spec, how the inputs are quantized
(None, "static": a calibrated scale, or "dynamic": computed per token / block at run time), the label
parts beyond the name, and the stored module the scheme becomes in a checkpoint, as the triple
(kind, weights, inputs) that ``export.module_schemes.ModuleScheme`` holds. Recipes
(``recipes.ptq_recipe.Scheme``), the quantized Linears and the checkpoint codecs read these rows instead
of testing a family's name; adding a scheme is adding a row (and its format, if new).

Rows with ``in_recipes=False`` are stored forms that recipes do not produce but checkpoints of other
tools hold (FP8 / MXFP8 weights with activations in the model dtype): they name what is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from .dispatch import fake_quantize
from .fp8 import FP8, dequantize_values, encode_with_scale, scale_from_amax
from .mx import MX
from .nvfp4 import NVFP4, input_encode_scale
from .nvfp4.weighted import WEIGHTED_RULES

#: (kind, weights, inputs) of a stored quantized Linear (see ``export.module_schemes.ModuleScheme``)
Stored = tuple[str, str, Optional[str]]


@dataclass(frozen=True)
class SchemeRow:
    """One scheme preset (see the module docstring). ``weight(options)``: the weight's format spec (None:
    high precision); ``inputs(options)``: None | "static" | "dynamic"; ``label(options)``: parts after the
    name (its non-default options); ``stores(kind, weights, inputs)``: whether a stored module of that
    triple is this scheme; ``block_size``: the block along in_features the weight needs whole (None: any
    in_features); ``weighted_rules``: the scale_rule values that weight the block error by calibration
    statistics (their stored format is ``weight``'s). ``stored(options)``: the (kind, weights, inputs) triple
    its Linears are stored as (None: high precision); ``input_quantizer(options, amax)``: x -> the inputs
    the scheme's inference Linear feeds its GEMM, with the static scale from the calibrated input ``amax``
    where it has one (None: weights only); ``noun``: how messages name the format whose blocks it needs;
    ``names_granularity``: a stored Linear's label adds "weights/inputs" (FP8: "fp8-w8a8 channel/token")."""

    name: str
    family: str
    options: Mapping[str, tuple[str, ...]]
    weight: Callable[[dict], object]
    inputs: Callable[[dict], Optional[str]]
    label: Callable[[dict], list[str]]
    stores: Callable[[str, str, Optional[str]], bool]
    stored: Callable[[dict], Optional[Stored]]
    input_quantizer: Callable[[dict, float], Optional[Callable]]
    noun: str = ""
    block_size: Optional[int] = None
    weighted_rules: frozenset = field(default_factory=frozenset)
    in_recipes: bool = True
    names_granularity: bool = False

    def defaults(self) -> dict[str, str]:
        return {k: v[0] for k, v in self.options.items()}


def _nvfp4_weight(o: dict):
    return WEIGHTED_RULES[o["scale_rule"]] if o["scale_rule"] in WEIGHTED_RULES else \
        NVFP4(scale_rule=o["scale_rule"], error=o["error"])


def _nvfp4_label(o: dict) -> list[str]:
    parts = []
    if o["scale_rule"] != "6":
        parts.append(o["scale_rule"] + (f"-{o['error']}" if o["scale_rule"] == "4over6" else ""))
    if o.get("act_scale_rule", "6") != "6":
        parts.append(f"a:{o['act_scale_rule']}")
    return parts


def _mx_label(o: dict) -> list[str]:
    return [o["scale_rule"]] if o["scale_rule"] != "ceil" else []


def _no_inputs(o: dict, amax: float) -> None:
    return None


def _nvfp4_inputs(o: dict, amax: float) -> Callable:
    """NVFP4 W4A4: the calibrated outer scale of ``input_encode_scale(amax, act_scale_rule)``, blocks as
    ``nn.NVFP4Linear.quantize_input`` rounds them."""
    enc = input_encode_scale(amax, o["act_scale_rule"])
    spec = NVFP4(scale_rule=o["act_scale_rule"], error=o["error"])
    return lambda x: fake_quantize(x, spec, encode_scale=enc.to(x.device), check_finite=False)


def _fp8_inputs(granularity: str, amax: float) -> Callable:
    """FP8 E4M3 inputs: "tensor" static s = amax / 448 (zero amax -> 1), "token" / "block" (1x128) dynamic."""
    if granularity == "tensor":
        s = scale_from_amax(torch.tensor(float(amax), dtype=torch.float32), "e4m3")
        return lambda x: dequantize_values(encode_with_scale(x, s.to(x.device), "e4m3"), s.to(x.device)).to(x.dtype)
    spec = FP8("e4m3", "token") if granularity == "token" else FP8("e4m3", "block", (1, 128))
    return lambda x: fake_quantize(x, spec, check_finite=False)


def _mx_inputs(element: str) -> Callable[[dict, float], Callable]:
    def make(o: dict, amax: float) -> Callable:
        spec = MX(element, o["scale_rule"])
        return lambda x: fake_quantize(x, spec, check_finite=False)
    return make


def _fp8_input_granularity(o: dict) -> str:
    return "tensor" if o["activations"] == "static" else "token"


_NVFP4_WEIGHT = {"scale_rule": ("6", "4over6", "sweep", "hessian", "hessian-4over6"), "error": ("mse", "mae", "maxabs")}
_MX = {"scale_rule": ("ceil", "floor")}
_HESSIAN = frozenset(WEIGHTED_RULES)

SCHEME_TABLE: tuple[SchemeRow, ...] = (
    SchemeRow("nvfp4-w4a4", "nvfp4", {**_NVFP4_WEIGHT, "act_scale_rule": ("6", "4over6")}, _nvfp4_weight,
              lambda o: "static", _nvfp4_label, lambda k, w, i: k == "nvfp4" and i is not None,
              lambda o: ("nvfp4", "nvfp4", "nvfp4"), _nvfp4_inputs, "NVFP4", NVFP4.block_size, _HESSIAN),
    SchemeRow("nvfp4-w4a16", "nvfp4", dict(_NVFP4_WEIGHT), _nvfp4_weight, lambda o: None, _nvfp4_label,
              lambda k, w, i: k == "nvfp4" and i is None, lambda o: ("nvfp4", "nvfp4", None), _no_inputs, "NVFP4",
              NVFP4.block_size, _HESSIAN),
    SchemeRow("fp8-w8a8", "fp8", {"weights": ("tensor", "channel"), "activations": ("static", "dynamic")},
              lambda o: FP8("e4m3", granularity=o["weights"]), lambda o: o["activations"],
              lambda o: [f"{o['weights']}/{o['activations']}"] if (o["weights"], o["activations"]) != ("tensor",
                                                                                                      "static") else [],
              lambda k, w, i: k == "fp8" and w != "block" and i is not None,
              lambda o: ("fp8", o["weights"], _fp8_input_granularity(o)),
              lambda o, amax: _fp8_inputs(_fp8_input_granularity(o), amax), "FP8", names_granularity=True),
    SchemeRow("fp8-block", "fp8", {}, lambda o: FP8("e4m3", "block", (128, 128)), lambda o: "dynamic",
              lambda o: [], lambda k, w, i: k == "fp8" and w == "block", lambda o: ("fp8", "block", "block"),
              lambda o, amax: _fp8_inputs("block", amax), "FP8", names_granularity=True),
    SchemeRow("fp8-w8a16", "fp8", {}, lambda o: FP8("e4m3"), lambda o: None, lambda o: [],
              lambda k, w, i: k == "fp8" and w != "block" and i is None, lambda o: ("fp8", "tensor", None),
              _no_inputs, "FP8", names_granularity=True, in_recipes=False),
    SchemeRow("mxfp8", "mx", dict(_MX), lambda o: MX("e4m3", scale_rule=o["scale_rule"]), lambda o: "dynamic",
              _mx_label, lambda k, w, i: k == "mx" and (w, i) == ("e4m3", "e4m3"), lambda o: ("mx", "e4m3", "e4m3"),
              _mx_inputs("e4m3"), "mxfp8 (MX)", MX.block_size),
    SchemeRow("mxfp4", "mx", dict(_MX), lambda o: MX("e2m1", scale_rule=o["scale_rule"]), lambda o: "dynamic",
              _mx_label, lambda k, w, i: k == "mx" and (w, i) == ("e2m1", "e2m1"), lambda o: ("mx", "e2m1", "e2m1"),
              _mx_inputs("e2m1"), "mxfp4 (MX)", MX.block_size),
    SchemeRow("mxfp4-w4a16", "mx", dict(_MX), lambda o: MX("e2m1", scale_rule=o["scale_rule"]), lambda o: None,
              _mx_label, lambda k, w, i: k == "mx" and (w, i) == ("e2m1", None), lambda o: ("mx", "e2m1", None),
              _no_inputs, "mxfp4-w4a16 (MX)", MX.block_size),
    SchemeRow("mxfp8-w8a16", "mx", {}, lambda o: MX("e4m3"), lambda o: None, lambda o: [],
              lambda k, w, i: k == "mx" and (w, i) == ("e4m3", None), lambda o: ("mx", "e4m3", None), _no_inputs,
              "mxfp8-w8a16 (MX)", MX.block_size, in_recipes=False),
    SchemeRow("bf16", "none", {}, lambda o: None, lambda o: None, lambda o: [], lambda k, w, i: k == "none",
              lambda o: None, _no_inputs, "high precision"),
)
_BY_NAME = {r.name: r for r in SCHEME_TABLE}

#: the names recipes may use, in table order
RECIPE_SCHEME_NAMES = tuple(r.name for r in SCHEME_TABLE if r.in_recipes)


def scheme_row(name: str) -> SchemeRow:
    """The row named ``name`` (KeyError when there is none)."""
    return _BY_NAME[name]


def stored_scheme_name(kind: str, weights: str, inputs: Optional[str]) -> str:
    """The name of the scheme a stored quantized Linear (kind, weights, inputs) is (the first row that
    stores it); ValueError for a triple no row stores."""
    for row in SCHEME_TABLE:
        if row.stores(kind, weights, inputs):
            return row.name
    raise ValueError(f"no quantization scheme stores a {kind} Linear with weights {weights!r} and inputs {inputs!r}")


def stored_scheme_label(kind: str, weights: str, inputs: Optional[str]) -> str:
    """The name of a stored Linear's scheme with what the name does not say: "fp8-w8a8 channel/token",
    "fp8-block block/token"; the name alone for rows whose options the stored form does not show."""
    for row in SCHEME_TABLE:
        if row.stores(kind, weights, inputs):
            return f"{row.name} {weights}/{inputs or 'none'}" if row.names_granularity else row.name
    return stored_scheme_name(kind, weights, inputs)  # (raises: no row stores it)


__all__ = ["RECIPE_SCHEME_NAMES", "SCHEME_TABLE", "SchemeRow", "Stored", "scheme_row", "stored_scheme_label",
           "stored_scheme_name"]
