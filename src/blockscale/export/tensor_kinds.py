"""What a quantized Linear's tensor format (NVFP4, FP8, MX) means to a checkpoint whatever the
checkpoint format stores it as: its buffers, the checks before
writing, its report entry, the scales fused siblings must share, its ``quantization_config.blockscale``
entries and the rules read back from them. Each checkpoint format's ``codecs.TensorCodec`` for one
kind holds a ``TensorKind``; the export and the loader ask it instead of testing a family's name.

    kind_of(ModuleScheme("fp8", "tensor", "tensor")) -> FP8     (ValueError for a kind none covers)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..nn.quantized_linear import weight_buffers
from ..quant import MX as MXSpec
from ..quant.mx import BLOCK as MX_BLOCK
from .module_checks import activation_meta, check_fp8_module, check_mx_module, check_nvfp4_module, mx_meta
from .scheme_types import ModuleRules, ModuleScheme

_GROUP_INPUT_HINT = " For activations: calibrate the group on its shared input (one amax)."


@dataclass(frozen=True)
class SharedScale:
    """A buffer fused siblings (q/k/v, gate/up) must hold bit for bit equal when ``applies(scheme)``;
    ``what`` / ``hint``: how the refusal names it and what it suggests."""

    buffer: str
    what: str
    applies: Callable[[ModuleScheme], bool]
    hint: str = ""


@dataclass(frozen=True)
class TensorKind:
    """name: the ``ModuleScheme.kind`` it covers; noun: how messages name its format;
    buffers(s): the module's quantized buffers (the empty module a loader builds: ``module_schemes.build_module``);
    check(name, m, s): ValueError for a module that cannot be written bit for bit; report(m, s): its
    report entry fields; shared: the scales fused siblings share; meta({name: (m, s)}): its
    ``quantization_config.blockscale`` entries; rules(name, s, blockscale section): its ``ModuleRules``;
    block_noun(s): what a Linear whose in_features are not whole blocks cannot be; summary(s): the
    blockscale ``scheme`` / ``activations`` of a checkpoint holding this one scheme only and no KV
    cache (None: the generic ``scheme`` / ``schemes`` summary)."""

    name: str
    noun: str
    buffers: Callable[[ModuleScheme], tuple]
    check: Callable[[str, nn.Module, ModuleScheme], None]
    report: Callable[[nn.Module, ModuleScheme], dict]
    shared: tuple
    meta: Callable[[dict], dict]
    rules: Callable[[str, ModuleScheme, dict], ModuleRules]
    block_noun: Callable[[ModuleScheme], str]
    summary: Optional[Callable[[ModuleScheme], dict]] = None

    def matches(self, s: ModuleScheme) -> bool:
        return s.kind == self.name


def _scalar(t: torch.Tensor) -> float:
    return float(t.reshape(-1)[0])


# ---- NVFP4 ------------------------------------------------------------------------------------------
def _nvfp4_report(m, s) -> dict:
    e = {"weight_global_scale": _scalar(m.weight_global_scale)}
    if s.inputs:
        e.update(input_global_scale=_scalar(m.input_global_scale), input_scale_rule=m.input_scale_rule,
                 input_error=m.input_error)
    return e


def _nvfp4_rules(name: str, s, bs: dict) -> ModuleRules:
    if not s.inputs:
        return ModuleRules()
    o = bs["input_overrides"].get(name, {})
    return ModuleRules(o.get("input_scale_rule") or bs["input_scale_rule"] or "6",
                       o.get("input_error") or bs["input_error"] or "mse")


NVFP4 = TensorKind(
    name="nvfp4", noun="NVFP4",
    buffers=lambda s: ("weight_packed", "weight_scale", "weight_global_scale") +
    (("input_global_scale",) if s.inputs else ()),
    check=lambda name, m, s: check_nvfp4_module(name, m), report=_nvfp4_report,
    shared=(SharedScale("weight_global_scale", "weight_global_scale (weight encode scale S)", lambda s: True),
            SharedScale("input_global_scale", "input_global_scale (activation encode scale)",
                        lambda s: bool(s.inputs), _GROUP_INPUT_HINT)),
    meta=lambda mods: activation_meta({n: m for n, (m, s) in mods.items() if s.inputs})
    if any(s.inputs for _, s in mods.values()) else {},
    rules=_nvfp4_rules, block_noun=lambda s: "NVFP4",
    summary=lambda s: {"scheme": "NVFP4" if s.inputs else "NVFP4A16", "activations": "W4A4" if s.inputs else "W4A16"})


def nvfp4_expected(names: dict, scalar: tuple) -> Callable[[ModuleScheme, int, int], dict]:
    """A codec's ``expected`` for NVFP4 stored under ``names`` (NVFP4Linear buffer -> suffix), outer
    scales FP32 of the ``scalar`` shapes: (s, N, K) -> {suffix: (dtypes, shapes)}."""
    def expected(s: ModuleScheme, N: int, K: int) -> dict:
        d = {names["weight_packed"]: ((torch.uint8,), ((N, K // 2),)),
             names["weight_scale"]: ((torch.float8_e4m3fn,), ((N, K // 16),)),
             names["weight_global_scale"]: ((torch.float32,), scalar)}
        if s.inputs:
            d[names["input_global_scale"]] = ((torch.float32,), scalar)
        return d
    return expected


# ---- FP8 --------------------------------------------------------------------------------------------
def _fp8_report(m, s) -> dict:
    e = {}
    if s.weights == "tensor":
        e["weight_scale"] = _scalar(m.weight_scale)
    if s.inputs == "tensor":
        e["input_scale"] = _scalar(m.input_scale)
    return e


FP8 = TensorKind(
    name="fp8", noun="FP8",
    buffers=lambda s: ("weight", "weight_scale") + (("input_scale",) if s.inputs == "tensor" else ()),
    check=check_fp8_module, report=_fp8_report,
    shared=(SharedScale("weight_scale", "FP8 weight_scale (per-tensor)", lambda s: s.weights == "tensor",
                        " For FP8: s = max amax over the group / 448."),
            SharedScale("input_scale", "FP8 input_scale (static activation scale)", lambda s: s.inputs == "tensor",
                        _GROUP_INPUT_HINT)),
    meta=lambda mods: {}, rules=lambda name, s, bs: ModuleRules(), block_noun=lambda s: s.name)


# ---- MX ---------------------------------------------------------------------------------------------
MX = TensorKind(
    name="mx", noun="MX",
    buffers=lambda s: tuple(weight_buffers(MXSpec(s.weights), MX_BLOCK, MX_BLOCK)),  # (the element's layout)
    check=check_mx_module, report=lambda m, s: {"scale_rule": m.scale_rule}, shared=(),
    meta=lambda mods: mx_meta({n: m for n, (m, s) in mods.items() if s.inputs}),
    rules=lambda name, s, bs: ModuleRules(scale_rule=bs["mx_scale_overrides"].get(name) or bs["mx_scale_rule"]
                                          or "ceil"),
    block_noun=lambda s: s.name)

#: every tensor kind, in the order the checks and the blockscale section visit them
TENSOR_KINDS: tuple[TensorKind, ...] = (NVFP4, FP8, MX)


def kind_of(s: ModuleScheme) -> TensorKind:
    """The ``TensorKind`` covering ``s``; ValueError for a kind none covers."""
    for k in TENSOR_KINDS:
        if k.matches(s):
            return k
    raise ValueError(f"no tensor kind covers a {s.kind!r} Linear")


def module_buffers(m: nn.Module, s: ModuleScheme) -> dict[str, torch.Tensor]:
    """The module's quantized buffers for ``s`` (detached), in the kind's order."""
    return {b: getattr(m, b).detach() for b in kind_of(s).buffers(s)}


__all__ = ["FP8", "MX", "NVFP4", "SharedScale", "TENSOR_KINDS", "TensorKind", "kind_of", "module_buffers",
           "nvfp4_expected"]
