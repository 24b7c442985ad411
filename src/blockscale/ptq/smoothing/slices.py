"""``WeightSlice``: a 2-D weight [N, K] read from a module (a Linear's weight, some of its output rows, an
expert's matrix of a fused 3-D parameter), as a producer (rows that absorb 1 / s: ``divide_rows``) or a
consumer (columns times s) of a smoothing group. Phi-3's fused ``qkv_proj`` value rows and ``gate_up_proj``
up rows, fused experts' up rows and MLA's ``kv_b_proj`` value rows are producers of this kind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

_PROJ_OF = {"gate_up_proj": "gate_up", "down_proj": "down"}


def _set_(p: torch.Tensor, value_fp32: torch.Tensor) -> None:
    p.copy_(value_fp32.to(p.dtype))


@dataclass(frozen=True)
class WeightSlice:
    """A 2-D weight [N, K] read from a module: ``module.<param>`` (an nn.Linear's or a router's weight),
    or expert ``expert``'s matrix of a fused 3-D parameter, optionally only its rows ``rows``
    (``gate_up_proj[e, I:]``: expert e's up rows). ``transposed``: the expert's matrix is stored in x @ W
    layout [K, N] (gpt-oss's ``gate_up_proj[e]`` [H, 2I]) and read as its transpose [N, K]; ``rows`` and
    ``index`` then pick rows of that transpose. ``tensor()`` is a view: writing it writes the parameter."""

    module: nn.Module
    param: str = "weight"
    expert: Optional[int] = None
    rows: Optional[tuple[int, int]] = None
    index: Optional[tuple[int, ...]] = None  # rows picked one by one (MLA: kv_b_proj's value rows)
    transposed: bool = False

    def _base(self) -> torch.Tensor:
        t = getattr(self.module, self.param)
        if self.expert is not None:
            t = t[self.expert]
        return t.transpose(-2, -1) if self.transposed else t

    def tensor(self) -> torch.Tensor:
        """The slice (a view, except with ``index``: a copy; write it back with ``write``)."""
        t = self._base()
        if self.rows is not None:
            t = t[self.rows[0]:self.rows[1]]
        if self.index is not None:
            t = t[torch.tensor(self.index, device=t.device)]
        return t

    def write(self, value_fp32: torch.Tensor) -> None:
        """Store ``value_fp32`` (shaped like ``tensor()``) into the parameter, cast to its dtype."""
        if self.index is None:
            _set_(self.tensor(), value_fp32)
            return
        t = self._base()
        if self.rows is not None:
            t = t[self.rows[0]:self.rows[1]]
        t[torch.tensor(self.index, device=t.device)] = value_fp32.to(t.dtype)

    @property
    def proj(self) -> Optional[str]:
        """"gate_up" / "down" for a fused expert slice, else None."""
        return _PROJ_OF.get(self.param) if self.expert is not None else None


def divide_rows(prev: WeightSlice, s: torch.Tensor) -> None:
    """The producer rows ``prev`` [K, *] divided by ``s`` [K] (FP32, stored back in the parameter's dtype),
    and, for an nn.Linear's weight, the same entries of its bias: the rows' outputs divided by s."""
    rows = prev.tensor()
    prev.write(rows.float() / s.to(rows.device)[:, None])
    bias = getattr(prev.module, "bias", None) if prev.param == "weight" else None
    if isinstance(bias, torch.Tensor):  # an nn.Linear's picked output rows: their bias too
        idx = torch.tensor(prev.index, device=bias.device) if prev.index is not None else None
        b = bias[idx] if idx is not None else bias[prev.rows[0]:prev.rows[1]] if prev.rows else bias
        val = (b.float() / s.to(bias.device)).to(bias.dtype)
        if idx is not None:
            bias[idx] = val
        else:
            b.copy_(val)


__all__ = ["WeightSlice", "divide_rows"]
