"""The export of a model that is not all-NVFP4-without-KV-scales: FP8 / MX / NVFP4 Linears in any
mix, and attention ``k_scale`` / ``v_scale`` (FP8 KV cache). The format's ``MixedFormat`` says how
each is stored (``ct_schemes``, ``modelopt_schemes``); here: the checks shared by every format, the
tensors, ``quantization_config.blockscale`` and the report entries.

Fused groups (q/k/v, gate/up, w1/w3) run as one GEMM, so their members must all be high precision or
all quantized with one scheme, and share the scales an engine takes the max of: NVFP4 outer (and
W4A4 input) scales, FP8 per-tensor weight scales and static input scales.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..nn.kv_cache import attention_modules
from .common import drop_shared
from .module_checks import activation_meta, check_module, kv_granularity, module_buffers, mx_meta
from .module_schemes import ModuleScheme, rules_of
from .registry import CheckpointFormat
from .shared_scales import check_shared_scales, sibling_groups

KV_FORMAT = "fp8-e4m3"


@dataclass(frozen=True)
class MixedPlan:
    schemes: dict  # module name -> ModuleScheme (model order)
    kv: dict  # attention module name -> (k_scale, v_scale)
    kv_granularity: Optional[str]  # None | "tensor" | "head"


def _check_groups(schemes: dict, linears: list) -> None:
    for group in sibling_groups(linears):
        got = {n: schemes.get(n) for n in group}
        kinds = {s.label if s is not None else "high precision" for s in got.values()}
        if len(kinds) > 1:
            listing = ", ".join(f"{n}: {s.label if s is not None else 'high precision'}" for n, s in got.items())
            raise ValueError(f"fused modules {group} have different schemes ({listing}); serving engines load the "
                             "group as one layer, so give all of them one scheme (or keep all in high precision)")


def _check_scales(quantized: dict, schemes: dict) -> None:
    groups = sibling_groups(list(quantized))
    by = lambda pred, buf: {n: getattr(m, buf) for n, m in quantized.items() if pred(schemes[n])}  # noqa: E731
    check_shared_scales(by(lambda s: s.kind == "nvfp4", "weight_global_scale"),
                        "weight_global_scale (weight encode scale S)", groups)
    check_shared_scales(by(lambda s: s.kind == "nvfp4" and s.inputs, "input_global_scale"),
                        "input_global_scale (activation encode scale)", groups,
                        " For activations: calibrate the group on its shared input (one amax).")
    check_shared_scales(by(lambda s: s.kind == "fp8" and s.weights == "tensor", "weight_scale"),
                        "FP8 weight_scale (per-tensor)", groups, " For FP8: s = max amax over the group / 448.")
    check_shared_scales(by(lambda s: s.kind == "fp8" and s.inputs == "tensor", "input_scale"),
                        "FP8 input_scale (static activation scale)", groups,
                        " For activations: calibrate the group on its shared input (one amax).")


def plan(model: nn.Module, fmt: CheckpointFormat, quantized: dict, schemes: dict, kv: dict,
         linears: list) -> MixedPlan:
    """Every check, before anything is written; ValueError naming the module otherwise."""
    if fmt.mixed is None:
        what = sorted({s.name for s in schemes.values() if not s.is_nvfp4}) or ["FP8 KV-cache scales"]
        raise ValueError(f"checkpoint format {fmt.name!r} stores NVFP4 Linears only, not {', '.join(what)}; use "
                         "format='compressed-tensors'")
    for n, m in quantized.items():
        check_module(n, m, schemes[n])
        if schemes[n].is_nvfp4:
            fmt.check_module(n, m)
    _check_groups(schemes, linears)
    _check_scales(quantized, schemes)
    g = kv_granularity(kv)
    if kv:
        attn = set(attention_modules(model))
        other, missing = sorted(set(kv) - attn), sorted(attn - set(kv))
        if other or missing:
            raise ValueError(f"FP8 KV-cache scales must be set on every attention module and only there (the "
                             f"checkpoint's KV-cache scheme covers all of them): "
                             f"{f'not attention modules: {other[:3]}' if other else f'missing on: {missing[:3]}'}")
    fmt.mixed.check(schemes, g)
    return MixedPlan(schemes, kv, g)


def blockscale_meta(p: MixedPlan, quantized: dict) -> dict:
    """Scheme summary + what the config cannot say (NVFP4 W4A4 activation rules, MX scale rules, KV)."""
    labels = Counter(s.label for s in p.schemes.values())
    meta: dict = {"scheme": next(iter(labels)) if len(labels) == 1 else "MIXED",
                  "schemes": dict(sorted(labels.items()))}
    w4a4 = {n: m for n, m in quantized.items() if p.schemes[n].kind == "nvfp4" and p.schemes[n].inputs}
    if w4a4:
        meta.update(activation_meta(w4a4))
    meta.update(mx_meta({n: m for n, m in quantized.items() if p.schemes[n].kind == "mx" and p.schemes[n].inputs}))
    if p.kv_granularity:
        meta["kv_cache"] = {"format": KV_FORMAT, "per_head": p.kv_granularity == "head"}
    return meta


def tensors(model: nn.Module, p: MixedPlan, quantized: dict, fmt: CheckpointFormat,
            state: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Every tensor to write: quantized modules as the format stores them, KV scales under its names,
    the rest of the state dict as it is (tied copies dropped); ``state``: that state dict when the
    caller renamed it (fused experts under hub names)."""
    state = drop_shared(model, model.state_dict()) if state is None else state
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> None:
        if key in out:
            raise ValueError(f"two tensors would be written as {key!r}")
        out[key] = t.detach()

    kv_keys = {f"{a}.{w}" for a in p.kv for w in ("k_scale", "v_scale")}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        s = p.schemes.get(mod)
        if key in kv_keys or (s is not None and leaf != "bias"):
            continue
        put(key, t)
    for name, m in quantized.items():
        s = p.schemes[name]
        bufs = module_buffers(m, s)
        if s.is_nvfp4:
            written = dict(fmt.export_tensor(b, t) for b, t in bufs.items())
        else:
            written = fmt.mixed.export_module(s, bufs)
        for suffix, t in written.items():
            put(f"{name}.{suffix}", t.contiguous())
    per_head = p.kv_granularity == "head"
    for attn, (k, v) in p.kv.items():
        kn, vn = fmt.mixed.kv_names(attn)
        put(kn, fmt.mixed.kv_export(k, per_head))
        put(vn, fmt.mixed.kv_export(v, per_head))
    return out


def report_entry(m: nn.Module, s: ModuleScheme) -> dict:
    e: dict = {"shape": [m.out_features, m.in_features], "bias": m.bias is not None, "scheme": s.label}
    if s.kind == "nvfp4":
        e["weight_global_scale"] = float(m.weight_global_scale.reshape(-1)[0])
        if s.inputs:
            e.update(input_global_scale=float(m.input_global_scale.reshape(-1)[0]),
                     input_scale_rule=m.input_scale_rule, input_error=m.input_error)
    elif s.kind == "fp8":
        if s.weights == "tensor":
            e["weight_scale"] = float(m.weight_scale.reshape(-1)[0])
        if s.inputs == "tensor":
            e["input_scale"] = float(m.input_scale.reshape(-1)[0])
    else:
        e["scale_rule"] = rules_of(m).scale_rule
    return e


def kv_report(p: MixedPlan) -> dict:
    return {a: {"k_scale": k.detach().float().reshape(-1).tolist(), "v_scale": v.detach().float().reshape(-1).tolist()}
            for a, (k, v) in p.kv.items()}


def bits_per_weight(quantized: dict) -> float:
    """Stored bits of codes + scales (+ the FP32 outer scale of NVFP4) per quantized weight element."""
    n = b = 0
    for m in quantized.values():
        n += m.out_features * m.in_features
        for buf in ("weight_packed", "weight", "weight_scale", "weight_global_scale"):
            t = m._buffers.get(buf)
            if t is not None:
                b += t.numel() * t.element_size()
    return round(b * 8 / n, 4) if n else math.nan


__all__ = ["KV_FORMAT", "MixedPlan", "bits_per_weight", "blockscale_meta", "kv_report", "plan", "report_entry",
           "tensors"]
