"""Checks of the quantized modules and KV scales a model holds before they are written (ValueError
naming the module and buffer): buffer dtypes and shapes as the checkpoint stores them, FP8 codes
without NaN bytes (0x7F / 0xFF), FP32 scales finite and > 0, UE8M0 scale bytes != 255 (NaN), KV
scales finite, > 0, [1] per layer or [H_kv] per head; plus the NVFP4 W4A4 activation metadata."""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from torch import nn

from ..nn.kv_cache import kv_scales
from .scheme_types import ModuleScheme

UE8M0_NAN = 255
E4M3_NAN_BYTES = (0x7F, 0xFF)


def _want(name: str, m: nn.Module, want: dict) -> None:
    for buf, (dt, shape) in want.items():
        t = getattr(m, buf)
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"{name}.{buf}: {t.dtype} {tuple(t.shape)}, expected {dt} {shape}")
    if m.bias is not None and tuple(m.bias.shape) != (m.out_features,):
        raise ValueError(f"{name}.bias: shape {tuple(m.bias.shape)}, expected ({m.out_features},)")


def check_nvfp4_module(name: str, m: nn.Module) -> None:
    """An NVFP4Linear's buffers: dtypes / shapes, outer scales positive and finite."""
    N, K = m.out_features, m.in_features
    want = {"weight_packed": (torch.uint8, (N, K // 2)), "weight_scale": (torch.float8_e4m3fn, (N, K // 16)),
            "weight_global_scale": (torch.float32, (1,))}
    if m.input_global_scale is not None:
        want["input_global_scale"] = (torch.float32, (1,))
    for buf, (dt, shape) in want.items():
        t = getattr(m, buf)
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"{name}.{buf}: {t.dtype} {tuple(t.shape)}, expected {dt} {shape}")
    for buf in ("weight_global_scale", "input_global_scale"):
        t = getattr(m, buf)
        if t is not None and not (bool(torch.isfinite(t).all()) and float(t.reshape(-1)[0]) > 0):
            raise ValueError(f"{name}.{buf}={float(t.reshape(-1)[0])!r}: outer scales must be positive and finite")
    if m.bias is not None and tuple(m.bias.shape) != (N,):
        raise ValueError(f"{name}.bias: shape {tuple(m.bias.shape)}, expected ({N},)")


def _positive(name: str, t: torch.Tensor) -> None:
    if t.is_meta:  # a streaming export's placeholder: checked when its layer was real (export.layer_tensors)
        return
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        v = float(t.reshape(-1)[int(bad.reshape(-1).to(torch.uint8).argmax())])
        raise ValueError(f"{name}={v!r}: FP32 scales must be finite and > 0 ({int(bad.sum())} of {t.numel()} are not)")


def _fp8_codes(name: str, t: torch.Tensor) -> None:
    if t.is_meta:  # (see _positive)
        return
    u = t.view(torch.uint8)
    n = int(((u == E4M3_NAN_BYTES[0]) | (u == E4M3_NAN_BYTES[1])).sum())
    if n:
        raise ValueError(f"{name}: {n} E4M3 codes are NaN (bytes 0x7f / 0xff)")


def check_fp8_module(name: str, m: nn.Module, s: ModuleScheme) -> None:
    """An FP8Linear's buffers: dtypes / shapes, codes without NaN bytes, scales finite and > 0."""
    N, K = m.out_features, m.in_features
    shape = {"tensor": (1,), "channel": (N, 1), "block": (-(-N // 128), -(-K // 128))}[s.weights]
    want = {"weight": (torch.float8_e4m3fn, (N, K)), "weight_scale": (torch.float32, shape)}
    if s.inputs == "tensor":
        want["input_scale"] = (torch.float32, (1,))
    _want(name, m, want)
    _fp8_codes(f"{name}.weight", m.weight)
    _positive(f"{name}.weight_scale", m.weight_scale)
    if s.inputs == "tensor":
        _positive(f"{name}.input_scale", m.input_scale)


def check_mx_module(name: str, m: nn.Module, s: ModuleScheme) -> None:
    """An MXLinear's buffers: dtypes / shapes, E4M3 codes without NaN bytes, UE8M0 scale bytes != 255."""
    N, K = m.out_features, m.in_features
    codes = ("weight", (torch.float8_e4m3fn, (N, K))) if s.weights == "e4m3" else \
        ("weight_packed", (torch.uint8, (N, K // 2)))
    _want(name, m, {codes[0]: codes[1], "weight_scale": (torch.uint8, (N, K // 32))})
    if s.weights == "e4m3":
        _fp8_codes(f"{name}.weight", m.weight)
    n = 0 if m.weight_scale.is_meta else int((m.weight_scale == UE8M0_NAN).sum())  # meta: see _positive
    if n:
        raise ValueError(f"{name}.weight_scale: {n} UE8M0 scale bytes are 255 (NaN)")


def kv_modules(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{attention module name: (k_scale, v_scale)} of every module with FP8 KV-cache scales."""
    out = {}
    for name, m in model.named_modules():
        kv = kv_scales(m)
        if kv is not None:
            out[name] = kv
    return out


def kv_granularity(kv: dict, formats: Optional[dict] = None) -> Optional[str]:
    """None (no KV scales), "tensor" (FP8, [1] per layer), "head" (FP8, [H_kv] per head) or "nvfp4" (NVFP4, [1] per
    layer; ``formats``: {attention module: ``nn.kv_cache.kv_format``}); ValueError for bad or mixed granularities
    or formats."""
    fmts = {n: (formats or {}).get(n) or "fp8-e4m3" for n in kv}
    if len(set(fmts.values())) > 1:
        raise ValueError("the KV cache is NVFP4 in some attention modules and FP8 in others; a checkpoint holds one "
                         "KV-cache format")
    kinds = set()
    for name, pair in kv.items():
        for which, t in zip(("k_scale", "v_scale"), pair):
            _positive(f"{name}.{which}", t.detach().to(torch.float32))
            if t.dim() != 1:
                raise ValueError(f"{name}.{which}: shape {tuple(t.shape)}, expected [1] (per layer) or [H_kv]")
            kinds.add("tensor" if t.numel() == 1 else "head")
    if len(kinds) > 1:
        raise ValueError("KV-cache scales are per layer in some attention modules and per head in others; a "
                         "checkpoint holds one granularity")
    if kinds and "nvfp4" in fmts.values():
        if kinds != {"tensor"}:
            raise ValueError("an NVFP4 KV cache has one k_scale / v_scale per layer ([1])")
        return "nvfp4"
    return kinds.pop() if kinds else None


def activation_meta(quantized: dict) -> dict:
    """``quantization_config.blockscale``'s W4A4 activation rule / error (most common) and overrides."""
    rules = {n: m.input_scale_rule for n, m in quantized.items()}
    errors = {n: m.input_error for n, m in quantized.items()}
    rule = Counter(rules.values()).most_common(1)[0][0]
    err = Counter(errors.values()).most_common(1)[0][0]
    meta = {"input_scale_rule": rule, "input_error": err}
    over = {n: {"input_scale_rule": rules[n], "input_error": errors[n]}
            for n in quantized if rules[n] != rule or errors[n] != err}
    if over:
        meta["input_overrides"] = over
    return meta


def mx_meta(mx: dict) -> dict:
    """``quantization_config.blockscale``'s MX activation scale rule (most common) and overrides."""
    if not mx:
        return {}
    rules = {n: m.scale_rule for n, m in mx.items()}
    rule = Counter(rules.values()).most_common(1)[0][0]
    meta = {"mx_scale_rule": rule}
    over = {n: r for n, r in rules.items() if r != rule}
    if over:
        meta["mx_scale_overrides"] = over
    return meta


__all__ = ["activation_meta", "check_fp8_module", "check_mx_module", "check_nvfp4_module", "kv_granularity",
           "kv_modules", "mx_meta"]
