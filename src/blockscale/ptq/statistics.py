"""Statistics of a Linear's calibration inputs, recorded by forward hooks while one decoder layer runs.

A method says what it needs (``StatisticsRequest``); every Linear always gets its token count and input
amax (the W4A4 activation outer scale). On request: the Hessian ``H = (2/n) sum_t x_t x_t^T`` (GPTQ),
the per-channel max |x| (SmoothQuant), and a strided sample of the input rows (AWQ's error search).

MoE experts of the per-expert nn.Linear layout (``linear_expert_blocks``) record the tokens routed to
each expert, or with ``calibrate_all_experts`` every token of their MoE block's input, once; fused 3-D
experts: ``ptq.fused_experts.ExpertStatistics``.
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import DataError
from .capture import run_layer


@dataclass(frozen=True)
class StatisticsRequest:
    """What a method records about each Linear's inputs besides tokens and amax.

    hessian: accumulate ``H`` [K, K] (``HessianAccumulator``). channel_absmax: per-input-channel max |x|
    [K]. sample_tokens: keep every ``ceil(total / sample_tokens)``-th input row (about ``sample_tokens``
    rows; 0: none), ``total`` being the calibration tokens of the whole run. channel_sqsum: per-input-channel
    sum of x^2 [K] in float64 (the diagonal of X^T X: Hessian-aware block scales, ``channel_weights``).
    """

    hessian: bool = False
    channel_absmax: bool = False
    sample_tokens: int = 0
    channel_sqsum: bool = False


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
        self.sqsum = torch.zeros(k, dtype=torch.float64, device=device) if request.channel_sqsum else None
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
        if self.sqsum is not None:
            self.sqsum += x2.double().square().sum(0)
        if self.sample_every:
            self.samples.append(x2[:: self.sample_every].clone())

    @property
    def H(self):
        """The Hessian [K, K] when one was requested and tokens were seen, else None."""
        return self.hessian.H if (self.hessian is not None and self.tokens) else None

    def channel_weights(self):
        """The per-input-channel mean of x^2 [K] (FP32: diag(X^T X) / tokens) when ``channel_sqsum`` was
        requested and tokens were seen, else None."""
        if self.sqsum is None or not self.tokens:
            return None
        return (self.sqsum / self.tokens).float()

    def sample(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.k)


def linear_expert_blocks(layer: nn.Module, linears: dict[str, nn.Linear]) -> list[tuple[nn.Module, list, list]]:
    """The per-expert nn.Linear MoE layout in ``layer`` (transformers-4 style: a ``ModuleList`` named
    ``experts`` of expert MLPs of nn.Linear, e.g. Mixtral ``block_sparse_moe.experts[e].w1/w2/w3``, Qwen
    ``mlp.experts[e].gate_proj/up_proj/down_proj``): (the MoE block owning the list, its experts, the full
    names of ``linears`` inside them), for the lists with at least one of ``linears``."""
    names = {id(m): n for n, m in linears.items()}
    out = []
    for n, m in layer.named_modules():
        if not isinstance(m, nn.ModuleList) or n.rpartition(".")[2] != "experts" or not len(m):
            continue
        inside = [names[id(x)] for x in m.modules() if id(x) in names]
        if inside:
            parent = n.rpartition(".")[0]
            out.append((layer.get_submodule(parent) if parent else layer, list(m), inside))
    return out


@contextmanager
def _all_tokens_through_experts(layer: nn.Module, linears: dict[str, nn.Linear], muted: set):
    """While the layer runs: each per-expert nn.Linear MoE block's routed calls record nothing (their
    Linears' names are in ``muted`` during the block's forward); after the block's forward, every expert
    runs on all of the block's input tokens, for statistics only (outputs dropped, the block's unchanged)."""
    handles = []
    for block, experts, inside in linear_expert_blocks(layer, linears):
        seen = {}

        def pre(mod, args, kwargs, inside=inside, seen=seen):
            seen["x"] = args[0] if args else kwargs["hidden_states"]
            muted.update(inside)

        def post(mod, args, kwargs, out, inside=inside, seen=seen, experts=experts):
            muted.difference_update(inside)
            x = seen.pop("x")
            x2 = x.reshape(-1, x.shape[-1])
            for expert in experts:
                expert(x2)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def collect_statistics(layer: nn.Module, index: int, inputs, linears: dict[str, nn.Linear],
                       request: StatisticsRequest, device, total_tokens: int,
                       calibrate_all_experts: bool = False, rounding: Optional[dict] = None) -> dict[str, InputStatistics]:
    """Run ``layer`` on the stored ``inputs`` and record each of ``linears``' inputs (name -> statistics).
    ``calibrate_all_experts``: the Linears of per-expert nn.Linear MoE experts (``linear_expert_blocks``)
    record every token of their MoE block's input, once (not their routed calls as well). ``rounding``: name ->
    x -> x as that Linear's quantized module rounds it; those Linears record their rounded inputs (the layer
    itself runs on the unrounded ones)."""
    stats = {n: InputStatistics(n, index, m.in_features, request, total_tokens, device) for n, m in linears.items()}
    muted: set = set()
    rounding = rounding or {}

    def hook(mod, args, out, n):
        if n not in muted:
            stats[n].add(rounding[n](args[0]) if n in rounding else args[0])

    handles = [m.register_forward_hook(lambda mod, args, out, n=n: hook(mod, args, out, n))
               for n, m in linears.items()]
    try:
        with _all_tokens_through_experts(layer, linears, muted) if calibrate_all_experts else nullcontext():
            run_layer(layer, inputs, device, keep_outputs=False)
    finally:
        for h in handles:
            h.remove()
    return stats


__all__ = ["HessianAccumulator", "InputStatistics", "StatisticsRequest", "collect_statistics", "linear_expert_blocks"]
