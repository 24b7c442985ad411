"""QuantizedTensor: the packed codes, block scales and outer scale of one quantized tensor."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from .checks import check_output_dtype
from .layout import check_layout
from .registry import format_of
from .transforms.swizzle import swizzle_scales


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor in a block-scaled format.

    codes: NVFP4 / MXFP4: uint8, two E2M1 codes per byte (element 2i in the low nibble), last dim
      padded to whole blocks; MXFP8: torch float8 values; S2F6: int8.
    scales: NVFP4: float8_e4m3fn, one per 16 values along the last dim; MX / S2F6: uint8 UE8M0
      biased exponents, one per 32 values.
    outer_scale: NVFP4 only: FP32 encode scale S = bound*6/amax, broadcastable against ``shape``
      (shape [] per tensor, [..., 1] per row, [G, 1, ...] per group).
    amax: NVFP4 only: the FP32 amax the outer scale came from (same shape as ``outer_scale``).
    shape / dtype: the original tensor's shape and dtype.
    For MX with ``spec.dim`` other than the last, codes and scales are stored with that dim moved last.
    """

    spec: Any  # a registered format spec (``registry.spec_types()``)
    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    outer_scale: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    signs: Optional[torch.Tensor] = None  # S2F6 with Hadamard: the ±1 rotation signs

    def dequantize(self, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
        """The represented values, as ``dtype`` (None: the original dtype); padding removed.
        ValueError if the codes / scales do not fit the shape and spec (``layout.check_layout``)."""
        dtype = self.dtype if dtype is None else dtype
        check_output_dtype(dtype)
        check_layout(self)
        return format_of(self.spec, "q.spec").dequantize(self, dtype)

    def scales_swizzled(self) -> torch.Tensor:
        """Block scales in the cuBLAS / CUTLASS 128x4 tiled layout (see ``swizzle_scales``)."""
        return swizzle_scales(self.scales)

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows ``start:stop`` of a 2-D tensor blocked along its last dim (e.g. the up rows of a fused gate/up
        weight), sharing storage: its codes and block scales for those rows, per-tensor fields as they are.
        ``rows(a, b).dequantize()`` equals ``dequantize()[a:b]`` bit for bit. ValueError for another
        shape, a tensor blocked along its rows (MX ``dim=0``), an empty or out-of-range slice, or one that
        cuts a scale's row group (FP8 128x128 tiles: ``start`` and ``stop`` on multiples of 128, or stop = N)."""
        fmt = format_of(self.spec, "q.spec")
        if len(self.shape) != 2 or fmt.blocked_dim(self.spec) % 2 != 1:
            raise ValueError(f"rows() needs a 2-D tensor blocked along its last dim; got shape {tuple(self.shape)} "
                             f"blocked along dim {fmt.blocked_dim(self.spec)}")
        N = self.shape[0]
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= N):
            raise ValueError(f"rows({start!r}, {stop!r}): expected 0 <= start < stop <= {N}")
        g = fmt.scale_rows(self.spec)
        if g > 1 and (start % g or (stop % g and stop != N)):
            raise ValueError(f"rows {start}:{stop}: one scale row covers {g} rows ({self.spec}); the slice must "
                             f"start and end on multiples of {g} (or end at {N})")

        def per_row(t):  # a field with one entry per row (outer scales per row), else shared
            return t if t is None or t.dim() != 2 or t.shape[0] != N or N == 1 else t[start:stop]

        scales = self.scales if g == 0 else self.scales[start // g:-(-stop // g)]
        return replace(self, codes=self.codes[start:stop], scales=scales, shape=torch.Size((stop - start, self.shape[1])),
                       outer_scale=per_row(self.outer_scale), amax=per_row(self.amax))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> "QuantizedTensor":
        """A copy with every tensor moved to ``device``."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, codes=mv(self.codes), scales=mv(self.scales), outer_scale=mv(self.outer_scale),
                       amax=mv(self.amax), signs=mv(self.signs))

    @property
    def nbytes(self) -> int:
        """Bytes of storage: codes + scales + outer scale."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.outer_scale) if t is not None)

    @property
    def bits_per_value(self) -> float:
        n = 1
        for d in self.shape:
            n *= d
        return 8.0 * self.nbytes / max(n, 1)

    def __repr__(self) -> str:
        kind = type(self.spec).__name__
        return (f"QuantizedTensor({kind}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"codes={tuple(self.codes.shape)}:{self.codes.dtype}, scales={tuple(self.scales.shape)}:{self.scales.dtype}, "
                f"spec={self.spec})")


__all__ = ["QuantizedTensor"]
