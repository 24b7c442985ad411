"""ModelOpt's tensor codecs: how a unified HF checkpoint stores NVFP4, FP8 and MXFP8 Linears, and the
``quant_algo`` each scheme is (``describe``; ModelOpt ``export/quant_utils.py``, vLLM ``modelopt.py``
``QUANT_ALGOS``):

    nvfp4-w4a4           NVFP4        weight u8 [N,K/2], weight_scale e4m3 [N,K/16], weight_scale_2 f32 []
    nvfp4-w4a16          W4A16_NVFP4    = fl(1/S) (the decode scale), input_scale f32 [] = fl(1/S_in) (W4A4)
    fp8-w8a8 tensor/tensor  FP8       weight e4m3 [N,K], weight_scale f32 [], input_scale f32 []
    fp8-w8a8 channel/token  FP8_PER_CHANNEL_PER_TOKEN  weight e4m3 [N,K], weight_scale f32 [N]
    mxfp8                MXFP8        weight e4m3 [N,K], weight_scale u8 [N,K/32]

Every other scheme (fp8-block: ModelOpt's FP8_PB_WO is weight-only with a [N/128,1,K/128,1] scale;
static per-channel or dynamic per-tensor FP8; weights-only FP8 / MXFP8; MXFP4) has no quant_algo, so
no codec: the format refuses it (``modelopt.unsupported``).
"""
from __future__ import annotations

import torch

from . import tensor_kinds
from .codecs import TensorCodec, register_codec
from .ct_codecs import fp8_tensor_scales
from .scheme_types import ModuleScheme
from .stored_checks import fp8_stored, mx_stored, nvfp4_stored

FORMAT_NAME = "modelopt"
GROUP_SIZE, MX_BLOCK = 16, 32
FLT_MAX = torch.finfo(torch.float32).max
NVFP4_ALGOS = {"NVFP4": ModuleScheme("nvfp4", "nvfp4", "nvfp4"), "W4A16_NVFP4": ModuleScheme("nvfp4", "nvfp4")}
ALGOS = {**NVFP4_ALGOS, "FP8": ModuleScheme("fp8", "tensor", "tensor"),
         "FP8_PER_CHANNEL_PER_TOKEN": ModuleScheme("fp8", "channel", "token"),
         "MXFP8": ModuleScheme("mx", "e4m3", "e4m3")}
ALGO_OF = {s: a for a, s in ALGOS.items()}
# in-memory NVFP4Linear buffer -> on-disk suffix
RENAME = {"weight_packed": "weight", "weight_scale": "weight_scale",
          "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}
_SCALAR = ((), (1,))


def reciprocal(S: torch.Tensor) -> torch.Tensor:
    """fl(1/S) in FP32, computed exactly as NVFP4 dequantization does (``1.0 / S``)."""
    return 1.0 / S.detach().to(torch.float32)


def encode_scale_from_decode(r: torch.Tensor, what: str = "weight_scale_2") -> torch.Tensor:
    """An FP32 S with fl(1/S) == r bit for bit (r = a stored decode scale), shape [1].

    fl(1/r) qualifies for every positive normal S (checked exhaustively on random FP32 bit patterns);
    its neighbours are tried as a safety net. Dequantization uses only fl(1/S), so the weights of the
    reloaded layer equal the original bit for bit even where S itself is not recovered.
    """
    r = r.detach().to(torch.float32).reshape(())
    if not (bool(torch.isfinite(r)) and float(r) > 0):
        raise ValueError(f"{what}={float(r)!r}: must be a positive finite FP32 value")
    c = 1.0 / r
    if not bool(torch.isfinite(c)):
        c = torch.tensor(FLT_MAX, dtype=torch.float32)
    up = down = c
    cands = [c]
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        cands += [up, down]
    for s in cands:
        if bool(torch.isfinite(s)) and float(s) > 0 and bool((1.0 / s) == r):
            return s.reshape(1)
    raise ValueError(f"{what}={float(r)!r}: no FP32 encode scale S has fl(1/S) equal to it")


def check_exportable_input_scale(name: str, S_in: torch.Tensor) -> None:
    """ModelOpt stores fl(1/S_in); the activation quantizer uses S_in itself, so S_in must be a
    reciprocal fixed point (what ``input_encode_scale`` produces) to reload bit for bit."""
    s = S_in.detach().to(torch.float32).reshape(())
    if not bool((1.0 / (1.0 / s)) == s):
        raise ValueError(f"{name}.input_global_scale={float(s)!r} is not a reciprocal fixed point (fl(1/fl(1/S)) "
                         f"= {float(1.0 / (1.0 / s))!r}); the ModelOpt format stores 1/S and would reload a "
                         "different activation scale. Snap it with blockscale.nn.reciprocal_fixed_point (as "
                         "input_encode_scale does) or export to compressed-tensors")


def _describe(s: ModuleScheme) -> str:
    return ALGO_OF[s]


def _has_algo(s: ModuleScheme) -> bool:
    return s in ALGO_OF


# ---- NVFP4 ------------------------------------------------------------------------------------------
def _nvfp4_export(s: ModuleScheme, bufs: dict) -> dict:
    """The decode scales fl(1/S), fl(1/S_in) as FP32 scalars under ModelOpt's names."""
    return {RENAME[b]: reciprocal(t).reshape(()) if b.endswith("global_scale") else t for b, t in bufs.items()}


def _nvfp4_read(s: ModuleScheme, t: dict) -> dict:
    """S recovered from fl(1/S) (``encode_scale_from_decode``), S_in = fl(1/input_scale)."""
    out = {"weight_packed": t["weight"], "weight_scale": t["weight_scale"],
           "weight_global_scale": encode_scale_from_decode(t["weight_scale_2"], "weight_scale_2")}
    if "input_scale" in t:
        r = t["input_scale"].to(torch.float32).reshape(())
        if not (bool(torch.isfinite(r)) and float(r) > 0):
            raise ValueError(f"input_scale={float(r)!r}: must be a positive finite FP32 value")
        out["input_global_scale"] = (1.0 / r).reshape(1)
    return out


def _nvfp4_check(name: str, m, s: ModuleScheme) -> None:
    """The input scale (W4A4) is a reciprocal fixed point."""
    if m.input_global_scale is not None:
        check_exportable_input_scale(name, m.input_global_scale)


def _nvfp4_outer(s: ModuleScheme) -> tuple:
    return ("weight_scale_2",) + (("input_scale",) if s.inputs else ())


# ---- FP8 / MXFP8 ------------------------------------------------------------------------------------
def _fp8_expected(s: ModuleScheme, N: int, K: int) -> dict:
    f32, w = (torch.float32,), ((torch.float8_e4m3fn,), ((N, K),))
    if s.weights == "channel":
        return {"weight": w, "weight_scale": (f32, ((N,), (N, 1)))}
    return {"weight": w, "weight_scale": (f32, _SCALAR), "input_scale": (f32, _SCALAR)}


def _fp8_export(s: ModuleScheme, bufs: dict) -> dict:
    """Per-tensor scales as FP32 scalars, per-channel ones as [N] (what ModelOpt writes)."""
    out = dict(bufs)
    ws = bufs["weight_scale"].to(torch.float32)
    out["weight_scale"] = ws.reshape(-1) if s.weights == "channel" else ws.reshape(())
    if "input_scale" in bufs:
        out["input_scale"] = bufs["input_scale"].to(torch.float32).reshape(())
    return out


def _fp8_read(s: ModuleScheme, t: dict) -> dict:
    out = dict(t)
    ws = t["weight_scale"].to(torch.float32)
    out["weight_scale"] = ws.reshape(-1, 1) if s.weights == "channel" else ws.reshape(1)
    if "input_scale" in t:
        out["input_scale"] = t["input_scale"].to(torch.float32).reshape(1)
    return out


def _as_is(s: ModuleScheme, t: dict) -> dict:
    return dict(t)


NVFP4 = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.NVFP4, export=_nvfp4_export, read=_nvfp4_read,
    expected=tensor_kinds.nvfp4_expected(RENAME, _SCALAR),
    describe=_describe, check_stored=nvfp4_stored(RENAME, lambda stored: stored.to(torch.float32)),
    stores=_has_algo, check=_nvfp4_check, siblings_share=_nvfp4_outer, experts_share=_nvfp4_outer))
FP8 = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.FP8, export=_fp8_export, read=_fp8_read, expected=_fp8_expected,
    describe=_describe, check_stored=fp8_stored, stores=_has_algo, experts_share=fp8_tensor_scales))
MX = register_codec(TensorCodec(
    format=FORMAT_NAME, kind=tensor_kinds.MX, export=_as_is, read=_as_is,
    expected=lambda s, N, K: {"weight": ((torch.float8_e4m3fn,), ((N, K),)),
                              "weight_scale": ((torch.uint8,), ((N, K // MX_BLOCK),))},
    describe=_describe, check_stored=mx_stored, stores=_has_algo))

__all__ = ["ALGOS", "ALGO_OF", "FP8", "MX", "NVFP4", "NVFP4_ALGOS", "RENAME", "check_exportable_input_scale",
           "encode_scale_from_decode", "reciprocal"]
