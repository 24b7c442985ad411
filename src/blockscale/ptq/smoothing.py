"""Per-input-channel smoothing before NVFP4 post-training quantization: AWQ and SmoothQuant.

A linear layer computes ``y = x W^T``. For any positive vector ``s`` over the K input channels,
``y = (x / s) (W * s)^T`` exactly, so the scales can move magnitude between the activations and the
weight columns without changing the full-precision function, as long as ``1 / s`` is folded into
whatever produces ``x`` (the preceding norm's weight, or the output rows of a preceding linear).
Chosen well, ``s`` makes the quantized product more accurate:

- AWQ (activation-aware weight quantization, W4A16): scale up the weight columns of input channels
  whose activations are large (they matter most to the output), chosen by a grid search of one
  exponent ``alpha`` that minimises the measured quantized output error (``awq_search``).
- SmoothQuant (W4A4 / W8A8): ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` moves activation
  outliers into the weights, which are easier to quantize (``smoothquant_scales``).

This module holds pure functions: the caller captures the group's calibration inputs (e.g. with
forward hooks on the consumer linears), computes scales, then folds them with ``fold_smoothing``.
Fold a group before searching the next group that shares modules with it (e.g. ``v_proj`` is both a
consumer of the q/k/v group and the ``prev`` of the o_proj group; either order is exact, but each
search must see the current weights).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from ..nn.nvfp4_linear import INPUT_SCALE_RULES, input_encode_scale
from ..quant import NVFP4, fake_quantize
from ..quant.nvfp4 import outer_scale

# smoothing scales are kept in [S_MIN, S_MAX]: W * s and x / s then stay far from FP32 / BF16 limits
S_MIN, S_MAX = 1e-4, 1e4
SQ_MIN, SQ_MAX = 1e-8, 1e8  # SmoothQuant's raw formula is not normalised, so its clamp is wider

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmoothingGroup:
    """One place where per-input-channel scales ``s`` [K] can be folded.

    name: e.g. "self_attn.qkv". prev: the module whose output channels are the consumers' inputs:
    a norm whose output is ``normalized(x) * weight (+ bias)`` (RMSNorm / LayerNorm; weight [K]) or
    an ``nn.Linear`` with K output features. linears: the consumers (all with in_features == K).
    linear_names / prev_name: their names relative to the decoder layer.
    """

    name: str
    prev: nn.Module
    linears: tuple[nn.Linear, ...]
    linear_names: tuple[str, ...]
    prev_name: str = ""

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
        if not isinstance(self.prev, nn.Module):
            raise TypeError(f"SmoothingGroup {self.name!r}: prev must be an nn.Module, got {type(self.prev).__name__}")
        if any(self.prev is m for m in linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: prev cannot also be a consumer")
        if isinstance(self.prev, nn.Linear):
            if self.prev.out_features != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: prev linear has out_features="
                                 f"{self.prev.out_features}, consumers have in_features={K}")
        else:
            w = getattr(self.prev, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.numel() != K:
                shape = None if not isinstance(w, torch.Tensor) else tuple(w.shape)
                raise ValueError(f"SmoothingGroup {self.name!r}: prev {type(self.prev).__name__} needs a 1-D "
                                 f"per-channel weight of size {K} to absorb the scales, got weight shape {shape}")

    @property
    def in_features(self) -> int:
        """K: the number of channels (length of the smoothing scales)."""
        return self.linears[0].in_features

    def weights(self) -> list[torch.Tensor]:
        """The consumers' weights [N_i, K] (the tensors ``awq_search`` / ``smoothquant_scales`` take)."""
        return [lin.weight for lin in self.linears]


def check_norm_absorbs_scales(norm: nn.Module) -> None:
    """Raise NotImplementedError unless ``norm``'s output is ``f(x) * weight (+ bias)`` per channel,
    i.e. dividing ``weight`` (and ``bias``) by s divides the output by s.

    Checked by a probe: run ``norm.forward`` (hooks are not triggered) on a fixed random input, double
    every other channel of its weight, run again, restore the weight bit for bit. A norm such as
    Gemma's ``x * (1 + weight)`` RMSNorm fails the probe: folding into it would change the model.
    """
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise NotImplementedError(f"{type(norm).__name__} has no 1-D per-channel weight to fold smoothing "
                                  "scales into")
    if w.dtype not in _FLOAT_DTYPES:
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
            w.mul_(factor.to(w.dtype))
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
        raise NotImplementedError(
            f"{type(norm).__name__}: scaling its weight does not scale its output per channel (e.g. "
            "Gemma's x * (1 + weight) RMSNorm); folding smoothing scales into it would change the model. "
            "Fold into a plain RMSNorm / LayerNorm, or skip smoothing for this group")


# (layer attribute names) for the decoder layers find_smoothing_groups understands
_LAYOUTS = (
    dict(kind="Hugging Face Llama-style (Llama, Mistral, Qwen2, Qwen3)", norm1="input_layernorm",
         attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj", attn_extra=("q_norm", "k_norm"),
         norm2="post_attention_layernorm", mlp="mlp", gate="gate_proj", up="up_proj", down="down_proj",
         names=("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")),
    dict(kind="blockscale.models.llama.TransformerBlock", norm1="attention_norm", attn="attention",
         q="wq", k="wk", v="wv", o="wo", attn_extra=(), norm2="ffn_norm", mlp="feed_forward",
         gate="w1", up="w3", down="w2",
         names=("attention.qkv", "attention.wo", "feed_forward.w1_w3", "feed_forward.w2")),
)


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _match_layout(layer: nn.Module, lay: dict) -> Optional[str]:
    """None if ``layer`` has exactly this layout, else why not."""
    A, M = lay["attn"], lay["mlp"]
    linears = [f"{A}.{lay[k]}" for k in ("q", "k", "v", "o")] + [f"{M}.{lay[k]}" for k in ("gate", "up", "down")]
    for path in (lay["norm1"], lay["norm2"], *linears):
        if _get(layer, path) is None:
            return f"no submodule {path!r}"
    for path in linears:
        if not isinstance(_get(layer, path), nn.Linear):
            return f"{path!r} is a {type(_get(layer, path)).__name__}, not nn.Linear"
    # every parameter must belong to a module we know the role of: an extra norm (Gemma 2's
    # pre_feedforward_layernorm), a router or experts (MoE), adapters... mean another dataflow
    allowed = [lay["norm1"], lay["norm2"], *linears, *(f"{A}.{e}" for e in lay["attn_extra"])]
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if owner not in allowed:
            return f"parameter {pname!r} belongs to no module of this layout"
    return None


def find_smoothing_groups(layer: nn.Module) -> list[SmoothingGroup]:
    """The smoothing groups of one decoder layer, in the order AWQ processes them.

    Supported: Hugging Face Llama-style layers (LlamaDecoderLayer and the layers that share its names
    and dataflow: Mistral, Qwen2, Qwen3) and ``blockscale.models.llama.TransformerBlock``:

      input_layernorm          -> q_proj, k_proj, v_proj     "self_attn.qkv"
      v_proj                   -> o_proj                     "self_attn.o_proj"  (only without GQA)
      post_attention_layernorm -> gate_proj, up_proj         "mlp.gate_up"
      up_proj                  -> down_proj                  "mlp.down_proj"

    v_proj -> o_proj is skipped when v_proj.out_features != o_proj.in_features (grouped-query
    attention repeats each value head, so one scale per o_proj input cannot be folded into v_proj),
    as AWQ does. The up_proj -> down_proj fold assumes the gated MLP ``down(act(gate(x)) * up(x))``.

    Raises NotImplementedError (naming the layer class) for any other layer, e.g. MoE blocks, fused
    qkv_proj / gate_up_proj, extra norms (Gemma 2/3), and for norms whose weight cannot absorb a
    division (Gemma's ``x * (1 + weight)`` RMSNorm).
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module, got {type(layer).__name__}")
    reasons = []
    for lay in _LAYOUTS:
        why = _match_layout(layer, lay)
        if why is not None:
            reasons.append(f"{lay['kind']}: {why}")
            continue
        A, M = lay["attn"], lay["mlp"]
        g = lambda key, parent: _get(layer, f"{parent}.{lay[key]}")  # noqa: E731
        q, k, v, o = g("q", A), g("k", A), g("v", A), g("o", A)
        gate, up, down = g("gate", M), g("up", M), g("down", M)
        norm1, norm2 = _get(layer, lay["norm1"]), _get(layer, lay["norm2"])
        for path, norm in ((lay["norm1"], norm1), (lay["norm2"], norm2)):
            try:
                check_norm_absorbs_scales(norm)
            except NotImplementedError as err:
                raise NotImplementedError(f"find_smoothing_groups({type(layer).__name__}): {err}") from None
            except ValueError as err:
                raise ValueError(f"find_smoothing_groups({type(layer).__name__}): {path}: {err}") from None
        if up.out_features != down.in_features:
            raise NotImplementedError(f"find_smoothing_groups({type(layer).__name__}): {M}.{lay['up']} has "
                                      f"{up.out_features} outputs but {M}.{lay['down']} {down.in_features} inputs")
        n_qkv, n_o, n_gu, n_d = lay["names"]
        p = lambda key, parent: f"{parent}.{lay[key]}"  # noqa: E731
        groups = [SmoothingGroup(n_qkv, norm1, (q, k, v), (p("q", A), p("k", A), p("v", A)), lay["norm1"])]
        if v.out_features == o.in_features:
            groups.append(SmoothingGroup(n_o, v, (o,), (p("o", A),), p("v", A)))
        groups.append(SmoothingGroup(n_gu, norm2, (gate, up), (p("gate", M), p("up", M)), lay["norm2"]))
        groups.append(SmoothingGroup(n_d, up, (down,), (p("down", M),), p("up", M)))
        return groups
    raise NotImplementedError(
        f"find_smoothing_groups: {type(layer).__name__} is not a supported decoder layer ("
        + "; ".join(reasons) + "). Build SmoothingGroup objects by hand for other architectures")


# --------------------------------------------------------------------------------------------------
# folding
# --------------------------------------------------------------------------------------------------
def _check_scales(s, K: int, what: str = "s") -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(s).__name__}")
    if s.dim() != 1 or s.numel() != K:
        raise ValueError(f"{what} has shape {tuple(s.shape)}, expected ({K},): one scale per input channel")
    if s.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} has dtype {s.dtype}; expected a floating tensor")
    s = s.detach().float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{what} must be finite and > 0 (got min {float(s.min())!r}, max {float(s.max())!r})")
    return s


def _set_(p: torch.Tensor, value_fp32: torch.Tensor) -> None:
    p.copy_(value_fp32.to(p.dtype))


def fold_smoothing(group: SmoothingGroup, s: torch.Tensor) -> None:
    """Fold per-input-channel scales ``s`` [K] into ``group`` in place: the consumers' weight columns
    are multiplied by s (``W[:, j] *= s[j]``) and the producer's output divided by s (a norm's weight
    and bias per channel; a prev linear's output rows and bias). Computed in FP32, then cast back to
    each parameter's dtype, so the full-precision function is unchanged up to that rounding.
    """
    if not isinstance(group, SmoothingGroup):
        raise TypeError(f"group must be a SmoothingGroup, got {type(group).__name__}")
    K = group.in_features
    s = _check_scales(s, K)
    prev = group.prev
    if not isinstance(prev, nn.Linear):
        check_norm_absorbs_scales(prev)  # before touching anything
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            sd = s.to(prev.weight.device)
            _set_(prev.weight, prev.weight.float() / sd[:, None])
            if prev.bias is not None:
                _set_(prev.bias, prev.bias.float() / sd)
        else:
            sd = s.to(prev.weight.device)
            _set_(prev.weight, prev.weight.float() / sd)
            bias = getattr(prev, "bias", None)
            if isinstance(bias, torch.Tensor):
                _set_(bias, bias.float() / sd)
        for lin in group.linears:
            sd = s.to(lin.weight.device)
            _set_(lin.weight, lin.weight.float() * sd)


# --------------------------------------------------------------------------------------------------
# argument checks shared by the scale functions
# --------------------------------------------------------------------------------------------------
def _check_weights(weights, K: Optional[int], fn: str) -> list:
    if isinstance(weights, (torch.Tensor, nn.Linear)):
        weights = [weights]
    try:
        weights = list(weights)
    except TypeError:
        raise TypeError(f"{fn}: weights must be a sequence of [N_i, K] tensors, got {type(weights).__name__}") from None
    if not weights:
        raise ValueError(f"{fn}: weights is empty; pass the weights of the group's linears")
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, nn.Linear):
            w = w.weight
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{fn}: weights[{i}] is a {type(w).__name__}, expected a tensor")
        if w.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{fn}: weights[{i}] has dtype {w.dtype}; expected a floating tensor")
        if w.dim() != 2:
            raise ValueError(f"{fn}: weights[{i}] has shape {tuple(w.shape)}; expected [N_i, K] (nn.Linear layout)")
        if K is None:
            K = w.shape[1]
        if w.shape[1] != K:
            raise ValueError(f"{fn}: weights[{i}] has shape {tuple(w.shape)}, expected K={K} input channels "
                             "(weights are [out_features, in_features])")
        if w.numel() and not bool(torch.isfinite(w).all()):
            raise ValueError(f"{fn}: weights[{i}] contains NaN/inf")
        out.append(w.detach())
    return out


def _check_alpha(alpha, fn: str) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"{fn}: alpha={alpha!r} must be a number in [0, 1]")
    return float(alpha)


# --------------------------------------------------------------------------------------------------
# SmoothQuant
# --------------------------------------------------------------------------------------------------
def smoothquant_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant scales ``s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)`` (FP32, shape [K]).

    act_absmax: [K] per-channel max |activation| over the calibration data (of the group's input).
    weights: the group's consumer weights [N_i, K] (the max runs over all their rows).
    Channels whose activation max or weight max is 0 get s = 1; the result is clamped to
    [SQ_MIN, SQ_MAX] = [1e-8, 1e8], so it is always finite and > 0. Computed in float64.
    """
    fn = "smoothquant_scales"
    alpha = _check_alpha(alpha, fn)
    if not isinstance(act_absmax, torch.Tensor):
        raise TypeError(f"{fn}: act_absmax must be a torch.Tensor, got {type(act_absmax).__name__}")
    if act_absmax.dim() != 1:
        raise ValueError(f"{fn}: act_absmax has shape {tuple(act_absmax.shape)}; expected [K] (one max per channel)")
    if act_absmax.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: act_absmax has dtype {act_absmax.dtype}; expected a floating tensor")
    a = act_absmax.detach().double()
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise ValueError(f"{fn}: act_absmax must be finite and >= 0 (it is a max of |x|)")
    ws = _check_weights(weights, a.numel(), fn)
    wmax = torch.stack([w.to(a.device).abs().double().amax(0) if w.shape[0] else torch.zeros_like(a)
                        for w in ws]).amax(0)
    valid = (a > 0) & (wmax > 0)
    ones = torch.ones_like(a)
    s = torch.where(valid, a, ones).pow(alpha) / torch.where(valid, wmax, ones).pow(1.0 - alpha)
    s = torch.where(valid, s, ones).clamp(SQ_MIN, SQ_MAX)
    return s.float()


# --------------------------------------------------------------------------------------------------
# AWQ
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AWQResult:
    """scales: [K] FP32, the chosen smoothing scales (fold them with ``fold_smoothing``).
    alpha: the chosen grid exponent (0.0 = no smoothing, scales all 1).
    error: the quantized output MSE with the chosen scales; baseline_error: with s = 1.
    errors: the MSE for each grid alpha ``i / n_grid``, i = 0 .. n_grid-1 (``alphas``).
    """

    scales: torch.Tensor
    alpha: float
    error: float
    baseline_error: float
    errors: tuple[float, ...]

    @property
    def alphas(self) -> tuple[float, ...]:
        n = len(self.errors)
        return tuple(i / n for i in range(n))

    @property
    def improvement(self) -> float:
        """baseline_error / error (>= 1; inf when the chosen error is 0 and the baseline is not)."""
        if self.error == 0:
            return 1.0 if self.baseline_error == 0 else math.inf
        return self.baseline_error / self.error


def _subsample_rows(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """At most ``max_tokens`` rows, evenly spaced over x (deterministic, covers every sequence)."""
    T = x.shape[0]
    if T <= max_tokens:
        return x
    idx = torch.div(torch.arange(max_tokens, dtype=torch.int64) * T, max_tokens, rounding_mode="floor")
    return x[idx.to(x.device)]


def awq_scales(x_mean: torch.Tensor, w_mean: Optional[torch.Tensor], alpha: float) -> torch.Tensor:
    """The AWQ candidate scales for one ``alpha`` (FP32 [K]).

    ``s = x_mean^alpha / w_mean^(1-alpha)`` (or ``x_mean^alpha`` when ``w_mean`` is None: no duo
    scaling), normalised by ``sqrt(max(s) * min(s))`` so the scales straddle 1, then clamped to
    [S_MIN, S_MAX]. Channels with x_mean == 0 (or w_mean == 0) get s = 1 and take no part in the
    normalisation. alpha == 0 gives s = 1 exactly (the unsmoothed baseline), with or without duo
    scaling. Computed in float64 log space.
    """
    xm = x_mean.detach().double()
    valid = xm > 0
    if w_mean is not None:
        wm = w_mean.detach().double().to(xm.device)
        valid = valid & (wm > 0)
    s = torch.ones_like(xm)
    if alpha == 0.0 or not bool(valid.any()):
        return s.float()
    log_s = alpha * torch.log(xm[valid])
    if w_mean is not None:
        log_s = log_s - (1.0 - alpha) * torch.log(wm[valid])
    log_s = log_s - 0.5 * (log_s.max() + log_s.min())  # s / sqrt(max * min)
    s[valid] = torch.exp(log_s).clamp(S_MIN, S_MAX)
    return s.float()


def _weight_mean(W: torch.Tensor) -> torch.Tensor:
    """Mean over output rows of |W| / max|W| of the row (AutoAWQ's duo-scaling weight statistic,
    normalised per output row; all-zero rows contribute 0)."""
    a = W.abs()
    amax = a.amax(1, keepdim=True)
    return torch.where(amax > 0, a / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(a)).mean(0)


# tokens x outputs per matmul chunk, and the largest reference output cached between candidates
_CHUNK_ELEMS = 1 << 24
_CACHE_ELEMS = 1 << 26


def awq_search(x: torch.Tensor, weights: Sequence[torch.Tensor], spec: NVFP4, *, act_scale_rule: Optional[str] = None,
               n_grid: int = 20, duo_scaling: bool = True, max_tokens: int = 4096) -> AWQResult:
    """AWQ grid search of per-input-channel scales for one group of linears sharing the input x.

    x: [..., K] the calibration inputs the consumers actually see (any leading dims; flattened to
      tokens). The per-channel statistics (mean |x|, max |x|) use every token; the error is measured
      on at most ``max_tokens`` evenly spaced tokens (deterministic).
    weights: the consumers' weights [N_i, K] (or the nn.Linear modules).
    spec: the NVFP4 weight format (scale rule "6", "4over6", "sweep", ...; rounding "nearest"). The
      group shares one outer encode scale S = outer_scale(max_i amax(W_i * s), spec.outer_bound), as
      fused serving layers require; ``spec.outer`` is ignored.
    act_scale_rule: None for W4A16; "6" or "4over6" for W4A4: the activations x / s are
      fake-quantized to NVFP4 (per-16 dynamic block scales) with the calibrated encode scale
      ``input_encode_scale(max|x / s|, rule)``, max over all calibration tokens.
    n_grid: alphas i / n_grid for i = 0 .. n_grid-1; alpha = 0 is s = 1 (the baseline).
    duo_scaling: s = x_mean^alpha / w_mean^(1-alpha) (AutoAWQ's default) instead of x_mean^alpha;
      w_mean = mean over all the group's rows of |W| / (max |W| of the row).

    For each alpha: W' = W * s (rounded to the weight dtype, as ``fold_smoothing`` stores it),
    Q = fake_quantize(W'_i, spec, encode_scale=S), X' = x / s (quantized for W4A4), and the error is
    the mean over tokens and all the members' outputs of (X' Q^T - x W^T)^2, in FP32. The alpha with
    the least error wins (ties: the smaller alpha), so ``error <= baseline_error`` always.
    """
    fn = "awq_search"
    if not isinstance(spec, NVFP4):
        raise TypeError(f"{fn}: spec must be a blockscale.quant.NVFP4, got {type(spec).__name__} "
                        "(AWQ here searches NVFP4 weight scales)")
    if spec.rounding != "nearest":
        raise ValueError(f"{fn}: spec.rounding={spec.rounding!r}; the search needs deterministic rounding "
                         "(rounding='nearest')")
    if act_scale_rule is not None and act_scale_rule not in INPUT_SCALE_RULES:
        raise ValueError(f"{fn}: act_scale_rule={act_scale_rule!r}; allowed: None (W4A16), "
                         + ", ".join(map(repr, INPUT_SCALE_RULES)))
    for name, value in (("n_grid", n_grid), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: {name}={value!r} must be an int >= 1")
    if not isinstance(duo_scaling, bool):
        raise ValueError(f"{fn}: duo_scaling={duo_scaling!r}: expected True or False")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: x has dtype {x.dtype}; expected a floating tensor")
    if x.dim() < 2:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)}; expected [tokens, K] (or [..., K])")
    K = x.shape[-1]
    ws = _check_weights(weights, K, fn)
    x2 = x.detach().reshape(-1, K)
    if x2.shape[0] == 0 or K == 0:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)}; need at least one token and one channel")
    if not bool(torch.isfinite(x2).all()):
        raise ValueError(f"{fn}: x contains NaN/inf")
    dev = x2.device

    # statistics over every token (cheap), error on a deterministic subsample
    x_mean = x2.abs().float().mean(0)
    x_absmax = x2.abs().amax(0).float()
    xs = _subsample_rows(x2, max_tokens).float()
    T = xs.shape[0]
    ws = [w.to(dev) for w in ws]
    W = torch.cat([w.float() for w in ws], 0)  # [N, K] reference weights
    N = W.shape[0]
    w_mean = _weight_mean(W) if duo_scaling else None
    act_spec = None if act_scale_rule is None else NVFP4(scale_rule=act_scale_rule)

    if act_spec is None:
        # ||x F^T||^2 = ||R F^T||^2 with x = QR: one QR of the tokens, then a [min(T,K), K] x [K, N]
        # product per candidate, a sum of squares (no cancellation)
        R = torch.linalg.qr(xs, mode="r").R if T > K else xs
        Y = None
    else:
        R = None
        Y = xs @ W.T if T * N <= _CACHE_ELEMS else None
    rows_per_chunk = max(1, _CHUNK_ELEMS // max(1, N))

    def error_of(s: torch.Tensor) -> float:
        Wp = [(w.float() * s).to(w.dtype) for w in ws]
        amax = torch.stack([w.abs().amax() if w.numel() else torch.zeros((), dtype=w.dtype, device=dev)
                            for w in Wp]).float().amax()
        S = outer_scale(amax.reshape(1), spec.outer_bound)
        Q = torch.cat([fake_quantize(w, spec, encode_scale=S, dtype=torch.float32) if w.numel()
                       else w.float() for w in Wp], 0)
        if act_spec is None:
            F = Q / s - W  # effective weight error in the original coordinates: X'Q^T - xW^T = x F^T
            total = 0.0
            for r0 in range(0, R.shape[0], rows_per_chunk):
                total += float((R[r0:r0 + rows_per_chunk] @ F.T).square().sum(dtype=torch.float64))
            return total / (T * N)
        a_enc = input_encode_scale(float((x_absmax / s).max()), act_scale_rule).to(dev)
        total = 0.0
        for r0 in range(0, T, rows_per_chunk):
            xc = xs[r0:r0 + rows_per_chunk]
            xq = fake_quantize(xc / s, act_spec, encode_scale=a_enc, check_finite=False)
            ref = Y[r0:r0 + rows_per_chunk] if Y is not None else xc @ W.T
            diff = torch.addmm(ref, xq, Q.T, beta=-1.0)  # xq Q^T - x W^T
            total += float(diff.square().sum(dtype=torch.float64))
        return total / (T * N)

    errors, cands = [], []
    for i in range(n_grid):
        alpha = i / n_grid
        s = awq_scales(x_mean, w_mean, alpha).to(dev)
        cands.append(s)
        errors.append(error_of(s))
    best = min(range(n_grid), key=lambda i: (errors[i], i))
    return AWQResult(scales=cands[best], alpha=best / n_grid, error=errors[best], baseline_error=errors[0],
                     errors=tuple(errors))


__all__ = [
    "AWQResult", "S_MAX", "S_MIN", "SmoothingGroup", "awq_scales", "awq_search", "check_norm_absorbs_scales",
    "find_smoothing_groups", "fold_smoothing", "smoothquant_scales",
]
