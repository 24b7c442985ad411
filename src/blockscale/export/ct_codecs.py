"""compressed-tensors' tensor codecs: how it stores NVFP4, FP8 and MX Linears, and the config-group
args each scheme is described by (``describe(s)`` -> (weights, input_activations, format)): the args
compressed-tensors 0.20.1's presets dump (``quant_scheme.py``; key order of ``QuantizationArgs.model_dump``)
and the format its ``infer_module_format`` picks (``compressors/format.py``):

    nvfp4-*              nvfp4-pack-quantized  weight_packed u8 [N,K/2], weight_scale e4m3 [N,K/16],
                                               weight_global_scale f32 [1] = S (+ input_global_scale [1])
    fp8 W8A8 / block     float-quantized       weight e4m3 [N,K], weight_scale f32 [1] | [N,1] |
    fp8 weights only     naive-quantized         [ceil(N/128), ceil(K/128)] (+ input_scale f32 [1], static)
    mxfp8 / mxfp8-w8a16  mxfp8-quantized       weight e4m3 [N,K], weight_scale u8 [N,K/32] (UE8M0)
    mxfp4 / mxfp4-w4a16  mxfp4-pack-quantized  weight_packed u8 [N,K/2], weight_scale u8 [N,K/32]

compressed-tensors' names are the modules' buffer names, so tensors are written as they are (outer
and FP8 scales as FP32 in the module's shape).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..nn.quantized_linear import weight_buffers
from ..quant import MX as MXSpec
from . import tensor_kinds
from .codecs import TensorCodec, register_codec
from .scheme_types import ModuleScheme
from .stored_checks import fp8_stored, mx_stored, nvfp4_stored

FORMAT_NAME = "compressed-tensors"
NVFP4_FORMAT = "nvfp4-pack-quantized"
FLOAT, NAIVE, MXFP8, MXFP4 = "float-quantized", "naive-quantized", "mxfp8-quantized", "mxfp4-pack-quantized"
_MX_ELEMENTS = {"e4m3": (MXFP8, 8), "e2m1": (MXFP4, 4)}  # MX element -> (format, bits)
E4M3_SCALE, U8_SCALE = "torch.float8_e4m3fn", "torch.uint8"
TILE, MX_BLOCK, NVFP4_BLOCK = 128, 32, 16
_F32 = (torch.float32, torch.bfloat16, torch.float16)  # other producers' scales may be 16-bit; ours are FP32
_SCALAR = ((1,), ())
NVFP4_NAMES = {b: b for b in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}


def args(num_bits: int, strategy: str, *, group_size=None, dynamic=False, scale_dtype=None, observer=None,
         block_structure=None) -> dict:
    """QuantizationArgs as compressed-tensors dumps them (its key order, unset options left out)."""
    a = {"num_bits": num_bits, "type": "float", "symmetric": True, "group_size": group_size, "strategy": strategy}
    if block_structure is not None:
        a["block_structure"] = list(block_structure)
    a["dynamic"] = dynamic
    if scale_dtype is not None:
        a["scale_dtype"] = scale_dtype
    if observer is not None:
        a["observer"] = observer
    return a


def _f32(t: torch.Tensor, shape) -> torch.Tensor:
    return t.to(torch.float32).reshape(shape)


# ---- NVFP4 ------------------------------------------------------------------------------------------
def _nvfp4_describe(s: ModuleScheme) -> tuple[dict, Optional[dict], str]:
    w = args(4, "tensor_group", group_size=NVFP4_BLOCK, scale_dtype=E4M3_SCALE)
    i = args(4, "tensor_group", group_size=NVFP4_BLOCK, dynamic="local", scale_dtype=E4M3_SCALE,
             observer="static_minmax") if s.inputs else None
    return w, i, NVFP4_FORMAT


def _nvfp4_export(s: ModuleScheme, bufs: dict) -> dict:
    """The encode scales S / S_in as FP32 [1], codes and block scales as they are."""
    return {b: _f32(t.detach(), 1) if b.endswith("global_scale") else t for b, t in bufs.items()}


def _nvfp4_read(s: ModuleScheme, t: dict) -> dict:
    out = {"weight_packed": t["weight_packed"], "weight_scale": t["weight_scale"],
           "weight_global_scale": _f32(t["weight_global_scale"], 1)}
    if t.get("input_global_scale") is not None:
        out["input_global_scale"] = _f32(t["input_global_scale"], 1)
    return out


def _nvfp4_outer(s: ModuleScheme) -> tuple:
    return ("weight_global_scale",) + (("input_global_scale",) if s.inputs else ())


# ---- FP8 --------------------------------------------------------------------------------------------
_FP8_INPUTS = {None: None, "tensor": args(8, "tensor", observer="static_minmax"),
               "token": args(8, "token", dynamic=True), "block": args(8, "group", group_size=TILE, dynamic=True)}


def _fp8_describe(s: ModuleScheme) -> tuple[dict, Optional[dict], str]:
    w = args(8, s.weights, block_structure=(TILE, TILE) if s.weights == "block" else None)
    return w, _FP8_INPUTS[s.inputs], FLOAT if s.inputs else NAIVE


def _fp8_expected(s: ModuleScheme, N: int, K: int) -> dict:
    shape = {"tensor": _SCALAR, "channel": ((N, 1), (N,)),
             "block": ((math.ceil(N / TILE), math.ceil(K / TILE)),)}[s.weights]
    d = {"weight": ((torch.float8_e4m3fn,), ((N, K),)), "weight_scale": (_F32, shape)}
    if s.inputs == "tensor":
        d["input_scale"] = (_F32, _SCALAR)
    return d


def _fp8_read(s: ModuleScheme, t: dict) -> dict:
    """FP32 scales in the module's shape."""
    out = dict(t)
    N = t["weight"].shape[0]
    ws = t["weight_scale"].to(torch.float32)
    out["weight_scale"] = ws.reshape({"tensor": (1,), "channel": (N, 1)}.get(s.weights, ws.shape))
    if "input_scale" in t:
        out["input_scale"] = _f32(t["input_scale"], 1)
    return out


def fp8_tensor_scales(s: ModuleScheme) -> tuple:
    """The per-tensor scales of an FP8 scheme (what one expert's gate and up must share)."""
    return (("weight_scale",) if s.weights == "tensor" else ()) + (("input_scale",) if s.inputs == "tensor" else ())


# ---- MX ---------------------------------------------------------------------------------------------
def mx_element(s: ModuleScheme) -> tuple[str, int]:
    """(compressed-tensors format, bits) of an MX scheme's element; an element compressed-tensors has no
    format for is refused rather than written under another's name."""
    try:
        return _MX_ELEMENTS[s.weights]
    except KeyError:
        raise ValueError(f"compressed-tensors has no format for MX element {s.weights!r} (it stores "
                         f"{', '.join(_MX_ELEMENTS)})") from None


def _mx_describe(s: ModuleScheme) -> tuple[dict, Optional[dict], str]:
    fmt, bits = mx_element(s)
    w = args(bits, "group", group_size=MX_BLOCK, scale_dtype=U8_SCALE)
    i = args(bits, "group", group_size=MX_BLOCK, dynamic=True, scale_dtype=U8_SCALE) if s.inputs else None
    return w, i, fmt


def _mx_expected(s: ModuleScheme, N: int, K: int) -> dict:
    """The MXLinear buffers of the element's layout (``nn.quantized_linear.weight_buffers``), as stored."""
    return {name: ((dtype,), (shape,)) for name, (_, shape, dtype) in weight_buffers(MXSpec(s.weights), N, K).items()}


def mx_element_of(fmt: str) -> tuple[str, int]:
    """(MX element, bits) a compressed-tensors MX format stores (the inverse of ``mx_element``)."""
    return next((element, bits) for element, (f, bits) in _MX_ELEMENTS.items() if f == fmt)


def _as_is(s: ModuleScheme, t: dict) -> dict:
    return dict(t)


NVFP4 = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.NVFP4, export=_nvfp4_export, read=_nvfp4_read,
    expected=tensor_kinds.nvfp4_expected(NVFP4_NAMES, _SCALAR),
    describe=_nvfp4_describe, check_stored=nvfp4_stored(NVFP4_NAMES, lambda stored: 1.0 / stored.to(torch.float32)),
    siblings_share=_nvfp4_outer, experts_share=_nvfp4_outer))
FP8 = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.FP8, export=_as_is, read=_fp8_read, expected=_fp8_expected,
    describe=_fp8_describe, check_stored=fp8_stored, experts_share=fp8_tensor_scales))
MX = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.MX, export=_as_is, read=_as_is, expected=_mx_expected,
    describe=_mx_describe, check_stored=mx_stored))

__all__ = ["FP8", "MX", "NVFP4", "NVFP4_FORMAT", "args", "fp8_tensor_scales", "mx_element"]
