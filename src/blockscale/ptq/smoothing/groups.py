"""Smoothing groups: where per-input-channel scales ``s`` [K] can be folded in a decoder layer.

A linear layer computes ``y = x W^T``. For any positive vector ``s`` over the K input channels,
``y = (x / s) (W * s)^T`` exactly, so scales can move magnitude between the activations and the
weight columns without changing the full-precision function, as long as ``1 / s`` is folded into
whatever produces ``x`` (the preceding norm's weight, or the output rows of a preceding linear).
A ``SmoothingGroup`` is one such producer and its consumers; ``families.find_smoothing_groups`` lists
them for the decoder layers of its table. AWQ and SmoothQuant (``ptq.methods``) choose the scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import math

import torch
from torch import nn

from .slices import WeightSlice

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class SmoothingGroup:
    """One place where per-input-channel scales ``s`` [K] can be folded.

    name: e.g. "self_attn.qkv". prev: what produces the consumers' inputs: a norm whose output is
    ``f(x) * (norm_offset + weight) (+ bias)`` per channel (RMSNorm / LayerNorm: norm_offset 0; Gemma's
    RMSNorm ``f(x) * (1 + weight)``: norm_offset 1; weight [K]), an ``nn.Linear`` with K output features,
    or a ``WeightSlice`` of K output rows of an nn.Linear's weight (Phi-3's fused ``qkv_proj`` value rows,
    ``gate_up_proj`` up rows; their bias entries are divided too). linears: the consumers (all with
    in_features == K). linear_names / prev_name: their names relative to the decoder layer.
    """

    name: str
    prev: Union[nn.Module, WeightSlice]
    linears: tuple[nn.Linear, ...]
    linear_names: tuple[str, ...]
    prev_name: str = ""
    norm_offset: float = 0.0

    def __post_init__(self):
        linears, names = tuple(self.linears), tuple(self.linear_names)
        object.__setattr__(self, "linears", linears)
        object.__setattr__(self, "linear_names", names)
        if not linears:
            raise ValueError(f"SmoothingGroup {self.name!r}: needs at least one consumer linear")
        if len(names) != len(linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: {len(linears)} linears but {len(names)} linear_names")
        for lin, n in zip(linears, names):
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"SmoothingGroup {self.name!r}: consumer {n!r} is a {type(lin).__name__}, "
                                "expected nn.Linear")
        K = linears[0].in_features
        for lin, n in zip(linears, names):
            if lin.in_features != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: consumer {n!r} has in_features="
                                 f"{lin.in_features}, expected {K} (all consumers share one input)")
        if len({id(m) for m in linears}) != len(linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: a consumer linear is listed twice")
        off = self.norm_offset
        if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off):
            raise ValueError(f"SmoothingGroup {self.name!r}: norm_offset={off!r} must be a finite number "
                             "(0: the norm scales by weight; 1: Gemma's 1 + weight)")
        object.__setattr__(self, "norm_offset", float(off))
        if isinstance(self.prev, WeightSlice):
            sl = self.prev
            if not (isinstance(sl.module, nn.Linear) and sl.param == "weight" and sl.expert is None
                    and not sl.transposed):
                raise ValueError(f"SmoothingGroup {self.name!r}: a WeightSlice prev must be output rows of an "
                                 "nn.Linear's weight (param 'weight', no expert, not transposed)")
            if any(sl.module is m for m in linears):
                raise ValueError(f"SmoothingGroup {self.name!r}: prev cannot also be a consumer")
            if sl.tensor().shape[0] != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: prev holds {sl.tensor().shape[0]} output rows, "
                                 f"consumers have in_features={K}")
            if self.norm_offset:
                raise ValueError(f"SmoothingGroup {self.name!r}: norm_offset applies to a norm prev only")
            return
        if not isinstance(self.prev, nn.Module):
            raise TypeError(f"SmoothingGroup {self.name!r}: prev must be an nn.Module or a WeightSlice, "
                            f"got {type(self.prev).__name__}")
        if any(self.prev is m for m in linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: prev cannot also be a consumer")
        if isinstance(self.prev, nn.Linear):
            if self.prev.out_features != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: prev linear has out_features="
                                 f"{self.prev.out_features}, consumers have in_features={K}")
            if self.norm_offset:
                raise ValueError(f"SmoothingGroup {self.name!r}: norm_offset applies to a norm prev only")
        else:
            w = getattr(self.prev, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.numel() != K:
                shape = None if not isinstance(w, torch.Tensor) else tuple(w.shape)
                raise ValueError(f"SmoothingGroup {self.name!r}: prev {type(self.prev).__name__} needs a 1-D "
                                 f"per-channel weight of size {K} to absorb the scales, got weight shape {shape}")

    @property
    def fold(self) -> str:
        """How 1 / s is folded into ``prev``: "norm" (weight / s), "norm_plus_one" ((1 + weight) / s - 1;
        any other norm_offset c: (c + weight) / s - c), "linear" (output rows / s) or "rows" (a slice of them)."""
        if isinstance(self.prev, WeightSlice):
            return "rows"
        if isinstance(self.prev, nn.Linear):
            return "linear"
        return "norm" if self.norm_offset == 0 else "norm_plus_one"

    @property
    def prev_module(self) -> nn.Module:
        """The module ``prev`` belongs to (the Linear of a WeightSlice)."""
        return self.prev.module if isinstance(self.prev, WeightSlice) else self.prev

    @property
    def in_features(self) -> int:
        """K: the number of channels (length of the smoothing scales)."""
        return self.linears[0].in_features

    def weights(self) -> list[torch.Tensor]:
        """The consumers' weights [N_i, K] (the tensors ``awq_search`` / ``smoothquant_scales`` take)."""
        return [lin.weight for lin in self.linears]


def check_norm_absorbs_scales(norm: nn.Module, offset: float = 0.0) -> None:
    """Raise NotImplementedError unless ``norm``'s output is ``f(x) * (offset + weight) (+ bias)`` per
    channel, i.e. replacing ``offset + weight`` (and ``bias``) by their quotients by s divides the output by s.

    Checked by a probe: run ``norm.forward`` (hooks are not triggered) on a fixed random input, double
    ``offset + weight`` on every other channel, run again, restore the weight bit for bit. With offset 0
    a norm such as Gemma's ``x * (1 + weight)`` RMSNorm fails the probe (folding into its weight as into
    a plain norm's would change the model); it passes with offset 1, and a plain RMSNorm then fails.
    """
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise NotImplementedError(f"{type(norm).__name__} has no 1-D per-channel weight to fold smoothing "
                                  "scales into")
    if w.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"{type(norm).__name__}.weight has dtype {w.dtype}; cannot fold scales into it")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{type(norm).__name__}.weight contains NaN/inf; cannot fold smoothing scales into it")
    K = w.numel()
    bias = getattr(norm, "bias", None)
    bias = bias.detach().float() if isinstance(bias, torch.Tensor) else None
    if bias is not None and bias.shape != w.shape:
        raise NotImplementedError(f"{type(norm).__name__}.bias has shape {tuple(bias.shape)}, weight {tuple(w.shape)}")
    g = torch.Generator().manual_seed(1234)
    probe = torch.randn(2, 3, K, generator=g).to(device=w.device, dtype=w.dtype)
    factor = torch.ones(K, dtype=torch.float32)
    factor[::2] = 2.0  # a power of two: exact in every float dtype
    factor = factor.to(w.device)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            y0 = norm.forward(probe)
            if offset == 0:
                w.mul_(factor.to(w.dtype))
            else:  # offset + w' = (offset + w) * factor
                w.copy_(((w.float() + offset) * factor - offset).to(w.dtype))
            y1 = norm.forward(probe)
    except Exception as err:  # a norm that needs extra arguments: we cannot vouch for it
        raise NotImplementedError(f"cannot check that {type(norm).__name__} absorbs per-channel scales "
                                  f"(its forward failed on a probe input: {err})") from err
    finally:
        with torch.no_grad():
            w.copy_(saved)
    if not isinstance(y0, torch.Tensor) or y0.shape != probe.shape:
        raise NotImplementedError(f"{type(norm).__name__}: its output is not a tensor shaped like its input; "
                                  "cannot fold smoothing scales into it")
    y0, y1 = y0.detach().float(), y1.detach().float()
    if bias is not None:
        y0, y1 = y0 - bias, y1 - bias
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 2e-2
    scale = float(y0.abs().max()) if y0.numel() else 0.0
    if not torch.allclose(y1, y0 * factor, rtol=tol, atol=tol * scale + 1e-30):
        if offset == 0:
            raise NotImplementedError(
                f"{type(norm).__name__}: scaling its weight does not scale its output per channel (e.g. "
                "Gemma's x * (1 + weight) RMSNorm); folding smoothing scales into it would change the model. "
                "Fold into a plain RMSNorm / LayerNorm (or, for a x * (1 + weight) norm, build the "
                "SmoothingGroup with norm_offset=1), or skip smoothing for this group")
        raise NotImplementedError(
            f"{type(norm).__name__}: scaling ({offset:g} + weight) does not scale its output per channel; it is "
            f"not a x * ({offset:g} + weight) norm, so folding smoothing scales into it that way would change "
            "the model")


__all__ = ["FLOAT_DTYPES", "SmoothingGroup", "check_norm_absorbs_scales"]
