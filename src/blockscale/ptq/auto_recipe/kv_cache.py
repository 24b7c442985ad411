"""The KV cache as a choice of the automatic recipe: which KV cache format, under a budget of bits per cached
element, hurts the loss least.

A recipe has one KV cache for the whole model (both checkpoint formats store one KV scheme), so this is one
choice among the KV candidates (``KV_CANDIDATES``: none, i.e. the cache stays in bf16; FP8 E4M3 and NVFP4, one
scale per layer: what both checkpoint formats store; ModelOpt has no per-head KV scales), under its own budget ``kv_cache_bits``: the KV cache is
memory per token, not weights, so its bits are not mixed into the weights' effective bits. Bits per cached
element: bf16 16, FP8 8, NVFP4 4 + 8/16 = 4.5 (its E4M3 scale per 16 along head_dim); the FP32 per-layer
scales are a constant per model, independent of the context length, and are not counted.

Scores, measured in the same passes as the units' (``sensitivity.measure``, the ``KVTap`` below) and in the same
units as theirs: for every attention layer, its post-RoPE keys K and values V (what the cache stores) are
fake-quantized as the KV cache does (``nn.kv_cache``: scales amax / 448 from the calibration text's amax per
layer, as PTQ's KV calibration) and

    "fisher"  1/2 sum over positions and elements of (dL/dK)^2 (K^ - K)^2 + (dL/dV)^2 (V^ - V)^2, per predicted
              token: the diagonal-Fisher estimate of the loss increase, as for the units;
    "output"  sum of (K^ - K)^2 + (V^ - V)^2 per calibration token.

summed over the layers. The choice: the candidate of least score whose bits fit the budget (bf16 scores 0, so it
wins whenever 16 bits fit); ties go to the fewer bits. Measured on the full-precision, unrotated model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ...errors import UsageError
from ...nn.kv_cache import (KVAmaxObserver, attention_modules, fp8_kv_fake_quantize, kv_scale_from_amax,
                            nvfp4_kv_fake_quantize, observe_kv)
from ...quant.nvfp4 import BLOCK as NVFP4_BLOCK
from ...recipes.ptq_recipe import KVCacheScheme

#: the KV candidate names (``kv_candidate`` turns one into a ``KVCacheScheme`` or None for the bf16 cache)
KV_CANDIDATES = ("bf16", "fp8-e4m3", "nvfp4")
KV_BITS = {"bf16": 16.0, "fp8-e4m3": 8.0, "nvfp4": 4.0 + 8.0 / NVFP4_BLOCK}


def kv_candidate(name: str) -> Optional[KVCacheScheme]:
    """The recipe's ``kv_cache`` for a KV candidate name (None: no KV cache quantization, the bf16 cache)."""
    if name not in KV_CANDIDATES:
        raise UsageError(f"kv candidate {name!r} is not supported; allowed values: {', '.join(KV_CANDIDATES)}")
    return None if name == "bf16" else KVCacheScheme(name)


def kv_candidates(value) -> tuple[str, ...]:
    """Checked KV candidate names from a list or a comma-separated string (None: all of ``KV_CANDIDATES``)."""
    if value is None:
        return KV_CANDIDATES
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")]
    if not isinstance(value, (list, tuple)) or not value:
        raise UsageError(f"kv_candidates={value!r}: expected a non-empty list; allowed values: "
                         f"{', '.join(KV_CANDIDATES)}")
    out = []
    for v in value:
        if v not in KV_CANDIDATES:
            raise UsageError(f"kv_candidates: {v!r} is not supported; allowed values: {', '.join(KV_CANDIDATES)}")
        if v in out:
            raise UsageError(f"kv_candidates: {v} is given twice")
        out.append(v)
    return tuple(out)


def kv_why_not(name: str, attn_modules: dict) -> Optional[str]:
    """Why the KV candidate ``name`` cannot quantize these attention modules (NVFP4: head_dim a multiple of 16)."""
    if name != "nvfp4":
        return None
    for n, attn in attn_modules.items():
        hd = getattr(attn, "head_dim", None)
        if isinstance(hd, int) and hd % NVFP4_BLOCK:
            return f"{n} has head_dim {hd}, not a multiple of {NVFP4_BLOCK}"
    return None


def choose_kv(names, scores, budget: float) -> int:
    """Index of the least-score candidate whose bits fit ``budget`` (ties: fewer bits, then the earlier one).
    UsageError when none fits."""
    fitting = [i for i, n in enumerate(names) if scores[i] is not None and KV_BITS[n] <= budget + 1e-9]
    if not fitting:
        low = min((KV_BITS[n] for n, s in zip(names, scores) if s is not None), default=None)
        raise UsageError(f"kv_cache_bits={budget:g} is below every usable KV candidate "
                         f"({', '.join(f'{n}: {KV_BITS[n]:g} bits' for n in names)}); allowed: kv_cache_bits >= "
                         f"{low:g}" if low is not None else "no KV candidate fits this model's attention")
    return min(fitting, key=lambda i: (scores[i], KV_BITS[names[i]], i))


def _fake_quantize(name: str, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return nvfp4_kv_fake_quantize(t, scale) if name == "nvfp4" else fp8_kv_fake_quantize(t, scale)


class _Recorder(KVAmaxObserver):
    """Keeps every attention call's live K / V (and, for "fisher", their gradients) in ``tap``."""

    def __init__(self, tap: "KVTap", fisher: bool):
        super().__init__(tap.attn)
        self.tap, self.fisher = tap, fisher

    def record(self, name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        tap, i = self.tap, len(self.tap.kv)
        tap.kv.append((name, k.detach(), v.detach()))
        if self.fisher:
            for j, t in enumerate((k, v)):
                if t.requires_grad:
                    t.register_hook(lambda g, i=i, j=j: tap.gs.__setitem__((i, j), g.detach()))


class _Exit:
    """A handle whose ``remove`` (what ``measure`` calls on hooks) leaves an observer's ``with`` block."""

    def __init__(self, observer: KVAmaxObserver):
        self.observer = observer.__enter__()

    def remove(self) -> None:
        self.observer.__exit__(None, None, None)


class KVTap:
    """The KV candidates' scores, as ``sensitivity.measure``'s taps: per-layer K / V amax in the "stats" pass,
    then per batch the K / V of every attention call (and their gradients for
    "fisher")."""

    def __init__(self, model: nn.Module, names, allowed):
        self.names, self.allowed = tuple(names), tuple(allowed)
        self.attn = attention_modules(model)
        self.acc = [0.0] * len(self.names)
        self.observer: Optional[KVAmaxObserver] = None
        self.kv: list = []     # (module name, K, V) of the current batch
        self.gs: dict = {}     # (call index, 0 = K / 1 = V) -> gradient

    def hooks(self, mode: str, fisher: bool):
        if mode == "stats":
            self.observer = observe_kv(self.attn)
            return [_Exit(self.observer)]
        return [_Exit(_Recorder(self, fisher))]

    def clear(self) -> None:
        self.kv, self.gs = [], {}

    def _scale(self, name: str, module: str, which: int) -> torch.Tensor:
        return kv_scale_from_amax(self.observer.amax[module][which])

    @torch.no_grad()
    def add_scores(self, fisher: bool) -> None:
        for c, name in enumerate(self.names):
            if not self.allowed[c] or name == "bf16":
                continue
            total = torch.zeros((), dtype=torch.float64)
            for i, (module, k, v) in enumerate(self.kv):
                for j, t in enumerate((k, v)):
                    d = _fake_quantize(name, t.float(), self._scale(name, module, j).to(t.device)) - t.float()
                    if fisher:
                        g = self.gs.get((i, j))
                        if g is not None:
                            total += 0.5 * (g.float() * d).square().sum(dtype=torch.float64)
                    else:
                        total += d.square().sum(dtype=torch.float64)
            self.acc[c] += float(total)

    def scores(self, per: int) -> list[Optional[float]]:
        """Each candidate's score (sum over batches / ``per``), 0 for bf16, None where not allowed."""
        return [None if not ok else 0.0 if n == "bf16" else a / per
                for n, ok, a in zip(self.names, self.allowed, self.acc)]




@dataclass(frozen=True)
class KVChoice:
    """The KV cache choice: ``names`` the candidates, ``scores`` theirs (None: does not fit the model),
    ``budget`` bits per cached element, ``chosen`` the chosen name."""

    names: tuple[str, ...]
    scores: tuple[Optional[float], ...]
    budget: float
    chosen: str

    @property
    def kv_cache(self) -> Optional[KVCacheScheme]:
        return kv_candidate(self.chosen)

    def lines(self) -> list[str]:
        cells = ", ".join(f"{n} ({KV_BITS[n]:g} bits) " + ("-" if s is None else f"{s:.3e}")
                          + ("*" if n == self.chosen else "") for n, s in zip(self.names, self.scores))
        return [f"KV cache (budget {self.budget:g} bits per cached element; * = chosen): {cells}"]

    def to_dict(self) -> dict:
        return {"budget": self.budget, "candidates": list(self.names), "scores": list(self.scores),
                "bits": [KV_BITS[n] for n in self.names], "chosen": self.chosen}


def kv_choice(names, scores, budget: float) -> KVChoice:
    """The ``KVChoice`` of least score within ``budget`` (``choose_kv``)."""
    return KVChoice(tuple(names), tuple(scores), budget, names[choose_kv(names, scores, budget)])


__all__ = ["KVChoice", "KVTap", "KV_BITS", "KV_CANDIDATES", "choose_kv", "kv_candidate", "kv_candidates", "kv_choice",
           "kv_why_not"]
