"""Wire codecs for Mixture-of-Experts all-to-all: token rows ``x [T, d]`` <-> bytes ``uint8 [T, row_bytes]``.

Every byte row encodes one token on its own, so rows can be split, reordered and sent to different
ranks. Fields are concatenated in this order; multi-byte fields are the native (little-endian)
bytes of the torch dtype:

    bf16   2d                 d bfloat16 values (x rounded RNE)
    nvfp4  d/2 + d/16 + 4     d/2 packed E2M1 codes (element 2i in the low nibble)
                              | d/16 E4M3 block scales | FP32 per-token outer encode scale S
                              (``NVFP4(outer="row")``: S = min(2688 / amax(row), FLT_MAX), 1 for a zero row)
    mxfp8  d + d/32           d E4M3 codes | d/32 UE8M0 biased exponents (``MX(element="e4m3")``)
    s2f6   d + d/32           d int8 codes of the rotated row | d/32 UE8M0 biased exponents
                              (``S2F6(hadamard=True, seed=seed)``; decode needs the same seed)

d must be a multiple of 16 (nvfp4) or 32 (mxfp8, s2f6). At d = 4096 that is 16, 4.5078, 8.25 and
8.25 bits per value. ``decode_rows(encode_rows(x))`` equals ``emulate(x)`` bit for bit.
"""
from __future__ import annotations

import torch

from ..checks import DTYPE_NAMES, INPUT_DTYPES, check_fp32_range
from ..dispatch import dequantize, fake_quantize, quantize
from ..mx import MX
from ..nvfp4 import NVFP4
from ..registry import format_of
from ..s2f6 import S2F6
from ..tensor import QuantizedTensor
from .hadamard import random_signs

# payload -> the format spec it carries (S2F6: the rotation seed is given per call)
_WIRE_SPECS = {"nvfp4": lambda seed: NVFP4(outer="row"), "mxfp8": lambda seed: MX(element="e4m3"),
               "s2f6": lambda seed: S2F6(hadamard=True, seed=seed)}
WIRE_PAYLOADS = ("bf16",) + tuple(_WIRE_SPECS)
# fields of a QuantizedTensor sent after codes and scales (one FP32 per row); the rest is rebuilt
_SENT_FIELDS = ("outer_scale",)


def _check_payload(payload) -> None:
    if payload not in WIRE_PAYLOADS:
        raise ValueError(f"payload={payload!r} is not supported; allowed values: "
                         f"{', '.join(map(repr, WIRE_PAYLOADS))}")


def _check_d(payload: str, d) -> None:
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ValueError(f"d={d!r}: expected a positive int (the row width)")
    spec = wire_spec(payload)
    block = 1 if spec is None else format_of(spec).block_size(spec)
    if d % block:
        raise ValueError(f"d={d}: payload {payload!r} needs d to be a multiple of {block} (its block size)")


def _fields(payload: str, d: int):
    """The byte row's fields in order: (dtype, number of elements per row)."""
    if payload == "bf16":
        return [(torch.bfloat16, d)]
    spec = wire_spec(payload)
    fmt = format_of(spec)
    lay = fmt.layout(spec, (1, d))
    out = [(lay[k][1], lay[k][0][-1]) for k in ("codes", "scales")]
    return out + [(torch.float32, 1)] * len(_sent_fields(payload))


def _sent_fields(payload: str) -> tuple:
    """The optional QuantizedTensor fields ``payload`` carries on the wire (NVFP4: the per-row outer scale)."""
    spec = wire_spec(payload)
    return tuple(n for n in format_of(spec).fields if n in _SENT_FIELDS)


def row_bytes(payload: str, d: int) -> int:
    """Bytes per encoded token row of width ``d``."""
    _check_payload(payload)
    _check_d(payload, d)
    return sum(n * dt.itemsize for dt, n in _fields(payload, d))


def wire_spec(payload: str, seed: int = 0):
    """The library format spec behind ``payload`` (None for "bf16")."""
    _check_payload(payload)
    return _WIRE_SPECS[payload](seed) if payload in _WIRE_SPECS else None


def _check_x(x, payload: str) -> None:
    _check_payload(payload)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, d], got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; allowed dtypes: {DTYPE_NAMES}")
    _check_d(payload, x.shape[1])
    # bf16 carries NaN/inf as they are; block scales of a non-finite block would be undefined
    if payload != "bf16" and x.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x contains {bad} NaN/inf value(s); payload {payload!r} needs finite values "
                         "(payload 'bf16' sends them as they are)")
    if payload != "bf16":
        check_fp32_range(x)


def _check_dtype(dtype) -> None:
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed values: {DTYPE_NAMES}")


def encode_rows(x: torch.Tensor, payload: str, *, seed: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Token rows ``x [T, d]`` (float) -> a new uint8 tensor ``[T, row_bytes(payload, d)]``.

    ``seed``: the S2F6 rotation signs; ``generator``: passed to ``quantize`` (used only by
    stochastic rounding, which the wire specs do not use).
    """
    _check_x(x, payload)
    if payload == "bf16":
        return x.detach().to(torch.bfloat16, copy=True).contiguous().view(torch.uint8)
    q = quantize(x, wire_spec(payload, seed), generator, check_finite=False)
    parts = [q.codes, q.scales] + [getattr(q, n) for n in _sent_fields(payload)]
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def _unpack(buf: torch.Tensor, payload: str, d: int, seed: int, dtype: torch.dtype):
    """Split the byte rows into typed fields; quantized payloads as a QuantizedTensor."""
    fields, start = [], 0
    for dt, n in _fields(payload, d):
        width = n * dt.itemsize
        # a fresh contiguous copy: column slices of a row-major buffer cannot be reinterpreted in place
        fields.append(buf[:, start:start + width].clone(memory_format=torch.contiguous_format).view(dt))
        start += width
    if payload == "bf16":
        return fields[0]
    spec = wire_spec(payload, seed)
    shape = torch.Size((buf.shape[0], d))
    # NVFP4: amax is not on the wire (only S); dequantize needs S alone. S2F6: the signs come from the seed.
    extra = dict(zip(_sent_fields(payload), fields[2:]))
    if "signs" in format_of(spec).fields:
        extra["signs"] = random_signs(format_of(spec).block_size(spec), seed, device=buf.device)
    return QuantizedTensor(spec=spec, codes=fields[0], scales=fields[1], shape=shape, dtype=dtype, **extra)


def decode_rows(buf: torch.Tensor, payload: str, d: int, *, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Byte rows ``buf`` (uint8 ``[T, row_bytes(payload, d)]``) -> a new ``[T, d]`` tensor of ``dtype``.

    ``seed`` must be the one used to encode (S2F6 rotation signs).
    """
    nbytes = row_bytes(payload, d)
    _check_dtype(dtype)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"buf has dtype {buf.dtype}; allowed dtype: torch.uint8 (the bytes from encode_rows)")
    if buf.dim() != 2 or buf.shape[1] != nbytes:
        raise ValueError(f"buf has shape {tuple(buf.shape)}; payload {payload!r} with d={d} needs "
                         f"[T, {nbytes}] (row_bytes({payload!r}, {d}) = {nbytes})")
    q = _unpack(buf, payload, d, seed, dtype)
    if payload == "bf16":
        return q.to(dtype)  # q is already a private copy
    return dequantize(q, dtype)


def emulate(x: torch.Tensor, payload: str, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode_rows(encode_rows(x))`` without bytes (fake quantization), for single-process runs.

    Values only: the result is detached from autograd, as ``fake_quantize``'s is.
    """
    _check_x(x, payload)
    _check_dtype(dtype)
    if payload == "bf16":
        return x.detach().to(torch.bfloat16, copy=True).to(dtype)
    return fake_quantize(x, wire_spec(payload, seed), dtype=dtype, check_finite=False)


__all__ = ["WIRE_PAYLOADS", "decode_rows", "emulate", "encode_rows", "row_bytes", "wire_spec"]
