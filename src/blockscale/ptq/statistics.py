"""Statistics of a Linear's calibration inputs, recorded by forward hooks while one decoder layer runs.

A method says what it needs (``StatisticsRequest``); every Linear always gets its token count and input
amax (the W4A4 activation outer scale). On request: the Hessian ``H = (2/n) sum_t x_t x_t^T`` (GPTQ),
the per-channel max |x| (SmoothQuant), and a strided sample of the input rows (AWQ's error search).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import DataError
from .capture import run_layer


@dataclass(frozen=True)
class StatisticsRequest:
    """What a method records about each Linear's inputs besides tokens and amax.

    hessian: accumulate ``H`` [K, K] (``HessianAccumulator``). channel_absmax: per-input-channel max |x|
    [K]. sample_tokens: keep every ``ceil(total / sample_tokens)``-th input row (about ``sample_tokens``
    rows; 0: none), ``total`` being the calibration tokens of the whole run.
    """

    hessian: bool = False
    channel_absmax: bool = False
    sample_tokens: int = 0


class HessianAccumulator:
    """Running ``H = (2/n) * sum_t x_t x_t^T`` [K, K] over calibration tokens.

    ``add(x)`` takes activations [..., K] (every leading index is a token) and updates the running
    mean: ``H <- H * n/(n+m) + (2/(n+m)) * X^T X`` for a chunk of m tokens. Accumulates in
    ``dtype`` (FP32 by default; FP64 for very long calibration runs).
    """

    def __init__(self, in_features: int, device=None, dtype: torch.dtype = torch.float32):
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features={in_features!r}: expected a positive int")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.float64")
        self.in_features = in_features
        self._H = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.n_tokens = 0

    @property
    def H(self) -> torch.Tensor:
        """The current Hessian estimate [K, K] (zeros before any ``add``)."""
        return self._H

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}"
                            + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., {self.in_features}] (in_features)")
        x2 = x.detach().reshape(-1, self.in_features).to(device=self._H.device, dtype=self._H.dtype)
        m = x2.shape[0]
        if m == 0:
            return
        n = self.n_tokens
        self._H.mul_(n / (n + m))
        self._H.addmm_(x2.T, x2, alpha=2.0 / (n + m))
        self.n_tokens = n + m


class InputStatistics:
    """Running statistics of the inputs of Linear ``name`` in decoder layer ``layer``: ``tokens``,
    ``amax``, and as requested ``hessian`` (a HessianAccumulator), ``absmax`` [K], ``sample()``."""

    def __init__(self, name: str, layer: int, k: int, request: StatisticsRequest, total_tokens: int, device):
        self.name, self.layer = name, layer
        self.k, self.tokens, self.amax = k, 0, 0.0
        self.hessian = HessianAccumulator(k, device=device) if request.hessian else None
        self.absmax = torch.zeros(k, dtype=torch.float32, device=device) if request.channel_absmax else None
        self.sample_every = max(1, math.ceil(total_tokens / request.sample_tokens)) if request.sample_tokens else 0
        self.samples: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, self.k).float()
        if x2.numel() == 0:
            return
        amax = float(x2.abs().max())  # NaN propagates through torch's max (not through Python's)
        if not math.isfinite(amax):
            bad = int((~torch.isfinite(x2)).sum())
            raise DataError(f"{self.name} (decoder layer {self.layer}): its calibration inputs contain NaN/inf "
                            f"({bad} of {x2.numel()} values); the previous layers overflow on this calibration "
                            "data (check the model's weights, and use float32 / bfloat16 rather than float16)")
        self.tokens += x2.shape[0]
        self.amax = max(self.amax, amax)
        if self.hessian is not None:
            self.hessian.add(x2)
        if self.absmax is not None:
            self.absmax = torch.maximum(self.absmax, x2.abs().amax(0))
        if self.sample_every:
            self.samples.append(x2[:: self.sample_every].clone())

    @property
    def H(self):
        """The Hessian [K, K] when one was requested and tokens were seen, else None."""
        return self.hessian.H if (self.hessian is not None and self.tokens) else None

    def sample(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.k)


@torch.no_grad()
def collect_statistics(layer: nn.Module, index: int, inputs, linears: dict[str, nn.Linear],
                       request: StatisticsRequest, device, total_tokens: int) -> dict[str, InputStatistics]:
    """Run ``layer`` on the stored ``inputs`` and record each of ``linears``' inputs (name -> statistics)."""
    stats = {n: InputStatistics(n, index, m.in_features, request, total_tokens, device) for n, m in linears.items()}
    handles = [m.register_forward_hook(lambda mod, args, out, s=stats[n]: s.add(args[0]))
               for n, m in linears.items()]
    try:
        run_layer(layer, inputs, device)
    finally:
        for h in handles:
            h.remove()
    return stats


__all__ = ["HessianAccumulator", "InputStatistics", "StatisticsRequest", "collect_statistics"]
