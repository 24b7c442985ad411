"""What an export writes for a model's quantized Linears and KV-cache scales, decided and checked
before anything is written: each Linear's scheme and the codec of the format that stores it, the KV
granularity, and the checks shared by every format; then the tensors, ``quantization_config.blockscale``
and the report entries. An all-NVFP4 model without KV-cache scales is the one-scheme case: its
kind's ``summary`` names it (``scheme`` "NVFP4" / "NVFP4A16", ``activations``), its tensors keep the
state dict's order and its report entries carry no ``scheme``.

Fused groups (q/k/v, gate/up, w1/w3) run as one GEMM, so their members must all be high precision or
all quantized with one scheme, and share the scales an engine takes the max of (``TensorKind.shared``:
NVFP4 outer and W4A4 input scales, FP8 per-tensor weight scales and static input scales).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..nn.kv_cache import attention_modules, kv_format
from .codecs import codec_for, refusal
from .module_checks import kv_granularity
from .registry import CheckpointFormat
from .shared_scales import check_group_membership, check_shared_scales, sibling_groups
from .tensor_kinds import TENSOR_KINDS, module_buffers

KV_FORMAT = "fp8-e4m3"


@dataclass(frozen=True)
class ExportPlan:
    schemes: dict  # module name -> ModuleScheme (model order)
    codecs: dict  # module name -> the format's TensorCodec for it
    kv: dict  # attention module name -> (k_scale, v_scale)
    kv_granularity: Optional[str]  # None | "tensor" | "head"
    summary: Optional[dict] = None  # the one scheme's blockscale summary (one NVFP4 scheme, no KV cache)


def _check_groups(schemes: dict, linears: list, single: bool) -> None:
    if single:
        return check_group_membership(set(schemes), linears)
    for group in sibling_groups(linears):
        got = {n: schemes.get(n) for n in group}
        kinds = {s.label if s is not None else "high precision" for s in got.values()}
        if len(kinds) > 1:
            listing = ", ".join(f"{n}: {s.label if s is not None else 'high precision'}" for n, s in got.items())
            raise ValueError(f"fused modules {group} have different schemes ({listing}); serving engines load the "
                             "group as one layer, so give all of them one scheme (or keep all in high precision)")
    return None


def _check_scales(quantized: dict, schemes: dict) -> None:
    groups = sibling_groups(list(quantized))
    for kind in TENSOR_KINDS:
        for sh in kind.shared:
            scales = {n: getattr(m, sh.buffer) for n, m in quantized.items()
                      if kind.matches(schemes[n]) and sh.applies(schemes[n])}
            check_shared_scales(scales, sh.what, groups, sh.hint)


def _check_kv(model: nn.Module, kv: dict) -> Optional[str]:
    g = kv_granularity(kv, {n: kv_format(model.get_submodule(n)) for n in kv})
    if kv:
        attn = set(attention_modules(model))
        other, missing = sorted(set(kv) - attn), sorted(attn - set(kv))
        if other or missing:
            raise ValueError(f"KV-cache scales must be set on every attention module and only there (the "
                             f"checkpoint's KV-cache scheme covers all of them): "
                             f"{f'not attention modules: {other[:3]}' if other else f'missing on: {missing[:3]}'}")
    return g


def plan(model: nn.Module, fmt: CheckpointFormat, quantized: dict, schemes: dict, kv: dict,
         linears: list) -> ExportPlan:
    """Every check, before anything is written; ValueError naming the module otherwise."""
    msg = refusal(fmt, schemes, "tensor" if kv else None)
    if msg is not None:
        raise ValueError(msg)
    codecs = {n: codec_for(fmt, s, n) for n, s in schemes.items()}
    one = set(schemes.values())
    summarize = next(iter(codecs.values())).kind.summary if len(one) == 1 and not kv else None
    for n, m in quantized.items():
        codecs[n].kind.check(n, m, schemes[n])
    for n, m in quantized.items():
        codecs[n].check(n, m, schemes[n])
    _check_groups(schemes, linears, summarize is not None)
    _check_scales(quantized, schemes)
    g = _check_kv(model, kv)
    fmt.check(schemes, g)
    return ExportPlan(schemes, codecs, kv, g, summarize(one.pop()) if summarize else None)


def blockscale_meta(p: ExportPlan, quantized: dict) -> dict:
    """Scheme summary + what the config cannot say (NVFP4 W4A4 activation rules, MX scale rules, KV)."""
    if p.summary is not None:
        meta = dict(p.summary)
    else:
        labels = Counter(s.label for s in p.schemes.values())
        meta = {"scheme": next(iter(labels)) if len(labels) == 1 else "MIXED", "schemes": dict(sorted(labels.items()))}
    for kind in TENSOR_KINDS:
        mods = {n: (m, p.schemes[n]) for n, m in quantized.items() if kind.matches(p.schemes[n])}
        if mods:
            meta.update(kind.meta(mods))
    if p.kv_granularity:
        meta["kv_cache"] = {"format": "nvfp4" if p.kv_granularity == "nvfp4" else KV_FORMAT,
                            "per_head": p.kv_granularity == "head"}
    return meta


def tensors(p: ExportPlan, quantized: dict, fmt: CheckpointFormat, state: dict) -> dict[str, torch.Tensor]:
    """Every tensor to write: ``state`` (the model's state dict to write, tied copies dropped) with each
    quantized module's buffers as its codec stores them, KV scales under the format's names. One-scheme
    plans keep the state's order; otherwise the quantized modules follow the other tensors."""
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> None:
        if key in out:
            raise ValueError(f"two tensors would be written as {key!r}")
        out[key] = t.detach()

    def put_module(name: str) -> None:
        s = p.schemes[name]
        for suffix, t in p.codecs[name].export(s, module_buffers(quantized[name], s)).items():
            put(f"{name}.{suffix}", t.contiguous())
        done.add(name)

    done: set = set()
    kv_keys = {f"{a}.{w}" for a in p.kv for w in ("k_scale", "v_scale")}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if key in kv_keys:
            continue
        if mod not in p.schemes or leaf == "bias":
            put(key, t)
        elif p.summary is not None and mod not in done:
            put_module(mod)
    for name in quantized:
        if name not in done:
            put_module(name)
    per_head = p.kv_granularity == "head"
    for attn, (k, v) in p.kv.items():
        kn, vn = fmt.kv.names(attn)
        put(kn, fmt.kv.export(k, per_head))
        put(vn, fmt.kv.export(v, per_head))
    return out


def report_entry(p: ExportPlan, name: str, m: nn.Module) -> dict:
    s = p.schemes[name]
    e: dict = {"shape": [m.out_features, m.in_features], "bias": m.bias is not None}
    if p.summary is None:
        e["scheme"] = s.label
    e.update(p.codecs[name].kind.report(m, s))
    return e


def kv_report(p: ExportPlan) -> dict:
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


__all__ = ["ExportPlan", "KV_FORMAT", "bits_per_weight", "blockscale_meta", "kv_report", "plan", "report_entry",
           "tensors"]
