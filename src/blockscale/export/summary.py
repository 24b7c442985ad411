"""What a written checkpoint's bytes are: quantized weights (NVFP4 packed codes, block and outer scales;
FP8 / MX codes and scales in mixed checkpoints) against
high-precision tensors (embeddings, lm_head, norms, Linears kept unquantized), for the one-line size
summary ``blockscale quantize`` and the demo print."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from safetensors import safe_open

from .common import REPORT_FILE

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
_DTYPE = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16", "U8": "uint8", "F8_E4M3": "fp8_e4m3"}


@dataclass(frozen=True)
class SizeBreakdown:
    """Bytes of tensor data: total = nvfp4 + high_precision (``nvfp4``: the quantized Linears' tensors,
    NVFP4 or, in mixed checkpoints, FP8 / MX too: ``weights`` names them); ``largest`` = (name, dtype,
    bytes) of the biggest high-precision tensor (None when there is none)."""

    total: int
    nvfp4: int
    high_precision: int
    largest: tuple | None
    weights: str = "NVFP4"

    def __str__(self) -> str:
        text = (f"checkpoint {_mb(self.total)}: {self.weights} weights {_mb(self.nvfp4)}, "
                f"high-precision tensors {_mb(self.high_precision)}")
        if self.largest is not None:
            name, dt, n = self.largest
            text += f" (largest: {name} {dt} {_mb(n)})"
        return text


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def size_breakdown(path: Union[str, os.PathLike]) -> SizeBreakdown:
    """Sizes of the checkpoint ``path`` just written by ``export_checkpoint``: a tensor belongs to the
    NVFP4 weights when its module is listed under ``quantized_modules`` in blockscale_report.json."""
    root = Path(path)
    report = json.loads((root / REPORT_FILE).read_text(encoding="utf-8"))
    quantized = set(report.get("quantized_modules", {}))
    scheme = (report.get("quantization") or {}).get("scheme")
    weights = "NVFP4" if scheme in (None, "NVFP4", "NVFP4A16") else "quantized"
    nvfp4 = high = 0
    largest = None
    for f in report["files"]:
        with safe_open(str(root / f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = _ITEMSIZE.get(sl.get_dtype(), 1)
                for d in sl.get_shape():
                    n *= d
                if name.rpartition(".")[0] in quantized:
                    nvfp4 += n
                else:
                    high += n
                    if largest is None or n > largest[2]:
                        largest = (name, _DTYPE.get(sl.get_dtype(), sl.get_dtype().lower()), n)
    return SizeBreakdown(nvfp4 + high, nvfp4, high, largest, weights)


__all__ = ["SizeBreakdown", "size_breakdown"]
