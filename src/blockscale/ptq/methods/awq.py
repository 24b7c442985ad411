"""AWQ (activation-aware weight quantization, Lin et al., 2024) for NVFP4, FP8 and MX.

Scale up the weight columns of input channels whose activations are large (they matter most to the
output): per-input-channel scales ``s = x_mean^alpha / w_mean^(1-alpha)``, one exponent ``alpha`` per
smoothing group chosen by a grid search of the measured quantized output error (``awq_search``), folded
into the preceding norm / linear (the full-precision function is unchanged); then the weights are RTN.
The error of a candidate is measured with the group's PTQ scheme (its weight format and shared scale,
its activation quantizer), so an FP8 or MX group searches against FP8 / MX rounding. Each search is
checked arguments -> statistics and quantizers -> one error function of s (``awq_error``) -> the grid
(``_grid_search``: every alpha scored, the least error kept).

MoE layers (``ptq.smoothing.moe``, ``awq_search_parts``): one scale vector per group as well, its error
the sum over the quantized consumers of ||Q(W s) (x / s) - W x||^2 on each consumer's own inputs (expert
e: the tokens routed to it, or every token with calibrate_all; each expert with its own outer scale, or
all experts with one for expert_outer_scale="tensor"); the router is rescaled but not in the error.
gpt-oss experts (no up -> down group: the clamped GLU is not linear in up): the error of expert e is measured
on its output ``_apply_gate(y + b_e) @ down_e`` (full-precision down) rather than on its gate/up GEMM output
y, since the GLU weighs the 2I outputs unequally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ...quant import NVFP4, fake_quantize
from ...quant.nvfp4 import INPUT_SCALE_RULES, input_encode_scale
from ..options import OptionError, check_options, option
from ..protocol import PTQMethod, QuantizedWeight
from ..scheme_quantize import input_quantizer, rtn_quantize
from ..smoothing import FLOAT_DTYPES, check_smoothable, check_weights, smooth_layer
from ..statistics import StatisticsRequest
from .awq_clip import awq_clip_search, clip_supported, subsample_rows
from .awq_error import group_error, part_input, parts_error, scheme_quantizers
from .gptq import GPTQ, GPTQOptions

# smoothing scales are kept in [S_MIN, S_MAX]: W * s and x / s then stay far from FP32 / BF16 limits
S_MIN, S_MAX = 1e-4, 1e4


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


def _check_grid(fn: str, n_grid, max_tokens) -> None:
    for name, value in (("n_grid", n_grid), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: {name}={value!r} must be an int >= 1")


def _resolve_scheme(fn: str, spec, act_scale_rule, scheme):
    """(spec, act_scale_rule, scheme) of ``awq_search``, checked; an NVFP4 scheme becomes its spec and
    act_scale_rule (scheme None), so it is the same search."""
    if scheme is not None:
        if spec is not None or act_scale_rule is not None:
            raise ValueError(f"{fn}: pass either scheme or spec / act_scale_rule, not both")
        if scheme.is_high_precision:
            raise ValueError(f"{fn}: scheme {scheme.name!r} keeps the weights in high precision: nothing to search")
        if isinstance(scheme.weight_spec, NVFP4):
            spec = scheme.weight_spec
            act_scale_rule = scheme.act_scale_rule if scheme.static_activations else None
            scheme = None
    if scheme is None and not isinstance(spec, NVFP4):
        raise TypeError(f"{fn}: spec must be a blockscale.quant.NVFP4, got {type(spec).__name__} "
                        "(AWQ with an NVFP4 spec; pass scheme=... for FP8 / MX)")
    if scheme is None and spec.rounding != "nearest":
        raise ValueError(f"{fn}: spec.rounding={spec.rounding!r}; the search needs deterministic rounding "
                         "(rounding='nearest')")
    if act_scale_rule is not None and act_scale_rule not in INPUT_SCALE_RULES:
        raise ValueError(f"{fn}: act_scale_rule={act_scale_rule!r}; allowed: None (W4A16), "
                         + ", ".join(map(repr, INPUT_SCALE_RULES)))
    return spec, act_scale_rule, scheme


def _checked_tokens(fn: str, x, weights):
    """(x as [tokens, K], the checked weights) of ``awq_search``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x has dtype {x.dtype}; expected a floating tensor")
    if x.dim() < 2:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)}; expected [tokens, K] (or [..., K])")
    K = x.shape[-1]
    ws = check_weights(weights, K, fn)
    x2 = x.detach().reshape(-1, K)
    if x2.shape[0] == 0 or K == 0:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)}; need at least one token and one channel")
    if not bool(torch.isfinite(x2).all()):
        raise ValueError(f"{fn}: x contains NaN/inf")
    return x2, ws


def _grid_search(x_mean, w_mean, n_grid: int, dev, error_of) -> AWQResult:
    """The grid alphas i / n_grid, each candidate ``awq_scales`` scored by ``error_of``; the least error
    wins (ties: the smaller alpha)."""
    errors, cands = [], []
    for i in range(n_grid):
        s = awq_scales(x_mean, w_mean, i / n_grid).to(dev)
        cands.append(s)
        errors.append(error_of(s))
    best = min(range(n_grid), key=lambda i: (errors[i], i))
    return AWQResult(scales=cands[best], alpha=best / n_grid, error=errors[best], baseline_error=errors[0],
                     errors=tuple(errors))


def awq_search(x: torch.Tensor, weights: Sequence[torch.Tensor], spec: Optional[NVFP4], *,
               act_scale_rule: Optional[str] = None, n_grid: int = 20, duo_scaling: bool = True,
               max_tokens: int = 4096, scheme=None) -> AWQResult:
    """AWQ grid search of per-input-channel scales for one group of linears sharing the input x.

    x: [..., K] the calibration inputs the consumers actually see (any leading dims; flattened to
      tokens). The per-channel statistics (mean |x|, max |x|) use every token; the error is measured
      on at most ``max_tokens`` evenly spaced tokens (deterministic).
    weights: the consumers' weights [N_i, K] (or the nn.Linear modules).
    spec: the NVFP4 weight format (scale rule "6", "4over6", "sweep", ...; rounding "nearest"). The
      group shares one outer encode scale S = shared_outer_scale(W_i * s, spec.outer_bound), as
      fused serving layers require; ``spec.outer`` is ignored.
    act_scale_rule: None for W4A16; "6" or "4over6" for W4A4: the activations x / s are
      fake-quantized to NVFP4 (per-16 dynamic block scales) with the calibrated encode scale
      ``input_encode_scale(max|x / s|, rule)``, max over all calibration tokens.
    n_grid: alphas i / n_grid for i = 0 .. n_grid-1; alpha = 0 is s = 1 (the baseline).
    duo_scaling: s = x_mean^alpha / w_mean^(1-alpha) (AutoAWQ's default) instead of x_mean^alpha;
      w_mean = mean over all the group's rows of |W| / (max |W| of the row).
    scheme: instead of ``spec`` / ``act_scale_rule`` (pass spec=None), a ``recipes.Scheme`` of any
      family: the weights are rounded as PTQ rounds them (``scheme_quantize.rtn_quantize`` with the
      group's shared scale ``group_weight_scale(scheme, W'_i)``: the NVFP4 outer scale, the FP8
      per-tensor scale) and the activations as the scheme's module quantizes them
      (``scheme_quantize.input_quantizer``, a static scale from max|x / s|). An NVFP4 scheme is the
      same search as its spec and act_scale_rule.

    For each alpha: W' = W * s (rounded to the weight dtype, as ``fold_smoothing`` stores it),
    Q = fake_quantize(W'_i, spec, encode_scale=S), X' = x / s (quantized for W4A4), and the error is
    the mean over tokens and all the members' outputs of (X' Q^T - x W^T)^2, in FP32. The alpha with
    the least error wins (ties: the smaller alpha), so ``error <= baseline_error`` always.
    """
    fn = "awq_search"
    spec, act_scale_rule, scheme = _resolve_scheme(fn, spec, act_scale_rule, scheme)
    _check_grid(fn, n_grid, max_tokens)
    if not isinstance(duo_scaling, bool):
        raise ValueError(f"{fn}: duo_scaling={duo_scaling!r}: expected True or False")
    x2, ws = _checked_tokens(fn, x, weights)
    dev = x2.device
    # statistics over every token (cheap), error on a deterministic subsample
    x_mean = x2.abs().float().mean(0)
    x_absmax = x2.abs().amax(0).float()
    xs = subsample_rows(x2, max_tokens).float()
    ws = [w.to(dev) for w in ws]
    W = torch.cat([w.float() for w in ws], 0)  # [N, K] reference weights
    w_mean = _weight_mean(W) if duo_scaling else None
    # weights as PTQ quantizes the group (an NVFP4 spec: with the group's outer scale), activations for W4A4
    qw, aq = scheme_quantizers(scheme, spec, act_scale_rule)
    quantizes_acts = act_scale_rule is not None if scheme is None else scheme.quantizes_activations
    error_of = group_error(xs, ws, W, qw, aq if quantizes_acts else None, x_absmax)
    return _grid_search(x_mean, w_mean, n_grid, dev, error_of)


def _prepare_parts(parts, spec, act_scale_rule, max_tokens: int, fn: str):
    """([(qw, aq, entries) per part], x_mean, the FP32 weights of every input, device) of
    ``awq_search_parts``."""
    prepared, means, n_rows, all_w, K, dev = [], None, 0, [], None, None
    for scheme, inputs in parts:
        if scheme is None and not isinstance(spec, NVFP4):
            raise TypeError(f"{fn}: a part without a scheme needs spec=NVFP4(...), got {type(spec).__name__}")
        qw, aq = scheme_quantizers(scheme, spec, act_scale_rule)
        entries = []
        for inp in inputs:
            x = inp[0]
            if K is None:
                K, dev = x.shape[-1], x.device
            e, row_sum, n = part_input(x, inp[1], inp[2] if len(inp) > 2 else None, K, dev, aq, max_tokens, fn)
            all_w.append(e["W"])
            if row_sum is not None:
                means = row_sum if means is None else means + row_sum
                n_rows += n
            entries.append(e)
        prepared.append((qw, aq, entries))
    if n_rows == 0:
        raise ValueError(f"{fn}: no input has a calibration token")
    return prepared, (means / n_rows).float(), all_w, dev


def awq_search_parts(parts, *, spec: Optional[NVFP4] = None, act_scale_rule: Optional[str] = None,
                     n_grid: int = 20, duo_scaling: bool = True, max_tokens: int = 4096) -> AWQResult:
    """AWQ grid search of one scale vector s [K] for a group whose consumers read different subsets of
    one input (an MoE layer's post-attention norm output: each expert the tokens routed to it, the shared
    expert all of them) or share a weight scale across inputs (experts with one outer scale for all).

    parts: a sequence of ``(scheme, [(x_j, [W_jk, ...]), ...])``: the weights of one part share one weight
      scale (``group_weight_scale(scheme, all its W'_jk)``; scheme None: ``spec`` / ``act_scale_rule`` as
      in ``awq_search``); x_j [T_j, K] are the calibration inputs of the weights W_jk [N_jk, K] (T_j may
      be 0: weights without inputs count for the shared scale only). An input may be a triple
      ``(x_j, [W_jk, ...], post_j)``: its error is then ||post_j(X'_j Q_j^T) - post_j(x_j W_j^T)||^2 with
      Q_j / W_j its weights' rows concatenated and post_j a function [T, N_j] -> [T, M_j] (counted as
      T_j M_j elements; gpt-oss experts: their output after the clamped GLU and full-precision down).
    Candidates: ``awq_scales(x_mean, w_mean, alpha)`` with x_mean = mean |x| over every row of every
    x_j (a token read by several inputs counts once per input) and w_mean over every part's rows.
    Error of s: sum over parts, inputs j and weights k of ||X'_j Q_jk^T - x_j W_jk^T||^2 on at most
    ``max_tokens`` evenly spaced rows of each x_j, divided by sum T_j N_jk, FP32 (float64 sums);
    W' = W * s rounded to the weight dtype, Q its quantized values with the part's shared scale,
    X'_j = x_j / s (W4A4: quantized with the static scale from max |x_j / s|, each input its own, as each
    expert's own input scale). The alpha with the least error wins (ties: the smaller), so
    ``error <= baseline_error`` (s = 1: round to nearest).
    """
    fn = "awq_search_parts"
    _check_grid(fn, n_grid, max_tokens)
    parts = list(parts)
    if not parts:
        raise ValueError(f"{fn}: parts is empty")
    prepared, x_mean, all_w, dev = _prepare_parts(parts, spec, act_scale_rule, max_tokens, fn)
    w_mean = _weight_mean(torch.cat(all_w, 0)) if duo_scaling else None
    count = sum(e["T"] * e["width"] for _, _, es in prepared for e in es)
    return _grid_search(x_mean, w_mean, n_grid, dev, parts_error(prepared, count))


AWQ_QUANTIZERS = ("rtn", "gptq")


@dataclass(frozen=True)
class AWQOptions:
    """Options of ``method="awq"`` (see ``awq_search``)."""

    grid: int = option(20, "AWQ grid: alphas i / grid for i = 0 .. grid-1", lo=1, hi=1000)
    duo_scaling: bool = option(True, "AWQ scales x_mean^alpha / w_mean^(1-alpha) (else x_mean^alpha)")
    max_tokens: int = option(4096, "AWQ measures the error on at most this many calibration tokens", lo=1)
    clip: Optional[bool] = option(None, "AWQ auto-clip: after smoothing, clip each 16-block's weights to r * its "
                                  "amax, r searched against the NVFP4 output error (awq_clip); default: on unless a "
                                  "scheme has a Hessian-aware scale rule or no weight is NVFP4")
    clip_grid: int = option(20, "AWQ auto-clip ratios 1 - i / clip-grid", lo=1, hi=1000)
    clip_max_shrink: float = option(0.5, "AWQ auto-clip: ratios down to 1 - clip-max-shrink (exclusive)", lo=0.0,
                                    hi=1.0, hi_open=True)
    clip_qk: bool = option(False, "AWQ auto-clip also clips q / k projections (AutoAWQ skips them)")
    quantizer: str = option("rtn", "AWQ rounds the smoothed weights to nearest (with auto-clip) or by GPTQ (its "
                            "default options, Hessians of the smoothed inputs; no clip)", choices=AWQ_QUANTIZERS)
    rounded_inputs: bool = option(False, "with --awq-quantizer gptq: GPTQ's --gptq-rounded-inputs (the Hessians of "
                                  "the W4A4 / W8A8 Linears' inputs as their quantized Linears round them)")

    def __post_init__(self):
        check_options(self)
        if self.quantizer == "gptq" and self.clip:
            raise OptionError(type(self).__name__, "clip", self.clip, "auto-clip rounds to nearest; it cannot be "
                              "combined with quantizer='gptq' (leave clip unset or False)")
        if self.rounded_inputs and self.quantizer != "gptq":
            raise OptionError(type(self).__name__, "rounded_inputs", self.rounded_inputs, "needs quantizer='gptq' "
                              "(the rounded inputs' Hessians are GPTQ's)")


# the last name component of the Linears auto-clip leaves alone unless clip_qk (AutoAWQ's q / k skip:
# their error passes through softmax(q k^T); fused q/k/v projections hold q and k rows)
QK_NAMES = ("q_proj", "k_proj", "wq", "wk", "query", "key", "qkv_proj", "Wqkv", "c_attn", "query_key_value")


class AWQ(PTQMethod):
    """Grid-searched smoothing scales per group (W4A4: against quantized activations too), folded; then RTN
    (with ``clip``: of each Linear's auto-clipped weights, ``awq_clip``, scored on the statistics recorded
    again after folding, so ``quantizes_with_statistics`` is then on), or with ``quantizer="gptq"`` GPTQ on the
    Hessians of the smoothed inputs (``GPTQ().quantize_weight``, bit for bit; a Hessian-aware scale rule goes
    inside its loop as with ``method="gptq"``)."""

    name = "awq"
    Options = AWQOptions
    flag_prefix = "awq"
    quantizes_fused_experts = True

    @classmethod
    def resolve_options(cls, options, schemes):
        """Auto-clip (``clip=None``) on unless a scheme has a Hessian-aware scale rule (those rules choose the block
        scales the clip search would) or no scheme's weights are NVFP4 with 1x16 blocks (the only ones it clips)."""
        if options.clip is not None:
            return options
        on = (options.quantizer == "rtn" and not any(s.hessian_scales for s in schemes)
              and any(clip_supported(s.weight_spec) for s in schemes))
        return replace(options, clip=on)

    def __init__(self, options=None):
        super().__init__(options)
        # the effective auto-clip (PTQConfig resolves None from its recipe; a bare AWQ() takes None as on)
        self.clip = self.options.clip is not False and self.options.quantizer == "rtn"
        if self.clip:
            self.quantizes_with_statistics = True  # the clip search reads the smoothed layer's inputs
        self._gptq = (GPTQ(GPTQOptions(rounded_inputs=self.options.rounded_inputs))
                      if self.options.quantizer == "gptq" else None)
        self.hessian_of_rounded_inputs = self.options.rounded_inputs
        if self._gptq is not None:  # GPTQ's traits: Hessians recorded again after folding, scales chosen in its loop
            self.quantizes_with_statistics = self.compares_to_rtn = True
            self.chooses_block_scales = self.weighs_block_scales = True
        self._clip_context = None  # (schemes, weight_spec, act_scale_rule, linear names) of the current layer

    def check_layer(self, layer, name: str) -> None:
        check_smoothable(layer, name, self.name)

    def _clip_input_quantizer(self, stats):
        """(clip?, the W4A4 input quantizer or None) for the Linear of ``stats``."""
        ctx = self._clip_context
        if ctx is None or stats is None or stats.name not in ctx[3] or not stats.tokens:
            return False, None  # not a Linear of the layer just transformed (an expert's projection, ...)
        if not self.options.clip_qk and stats.name.rpartition(".")[2] in QK_NAMES:
            return False, None
        schemes, spec, act_rule = ctx[0], ctx[1], ctx[2]
        scheme = schemes.get(stats.name) if schemes else None
        if scheme is not None:
            return True, input_quantizer(scheme, stats.amax)
        if act_rule is None:
            return True, None
        enc = input_encode_scale(stats.amax, act_rule)
        act = NVFP4(scale_rule=act_rule)
        return True, lambda x: fake_quantize(x, act, encode_scale=enc.to(x.device), check_finite=False)

    def quantize_weight(self, weight, stats, spec, encode_scale) -> QuantizedWeight:
        if self._gptq is not None:
            return self._gptq.quantize_weight(weight, stats, spec, encode_scale)
        if not self.clip or not clip_supported(spec):
            return super().quantize_weight(weight, stats, spec, encode_scale)
        clip, aq = self._clip_input_quantizer(stats)
        if not clip:
            return super().quantize_weight(weight, stats, spec, encode_scale)
        o = self.options
        res = awq_clip_search(weight, stats.sample(), spec, encode_scale, act_quantizer=aq, n_grid=o.clip_grid,
                              max_shrink=o.clip_max_shrink, max_tokens=o.max_tokens)
        return QuantizedWeight(rtn_quantize(res.weight, spec, encode_scale), latent=res.weight)

    def quantize_weight_weighted(self, weight, stats, spec, encode_scale, rule: str) -> QuantizedWeight:
        """quantizer "gptq": GPTQ with the Hessian-aware ``rule`` inside its loop (``HessianScales`` calls it)."""
        return self._gptq.quantize_weight_weighted(weight, stats, spec, encode_scale, rule)

    def statistics(self) -> StatisticsRequest:
        return StatisticsRequest(sample_tokens=self.options.max_tokens, hessian=self._gptq is not None)

    def transform_layer(self, layer) -> dict[str, float]:
        o = self.options
        self._clip_context = (layer.schemes, layer.weight_spec, layer.act_scale_rule, frozenset(layer.linears))

        names = {id(m): n for n, m in layer.linears.items()}

        def choose(group, st, weights):
            scheme = layer.schemes[names[id(group.linears[0])]] if layer.schemes else None
            if scheme is None:  # the flat NVFP4 context
                kw = dict(spec=layer.weight_spec, act_scale_rule=layer.act_scale_rule)
            else:
                kw = dict(spec=None, scheme=scheme)
            res = awq_search(st.sample(), weights, n_grid=o.grid, duo_scaling=o.duo_scaling,
                             max_tokens=o.max_tokens, **kw)
            return res.scales, res.alpha

        def choose_parts(group, parts):  # an MoE group: each expert on its own inputs (smoothing.GroupPart)
            res = awq_search_parts([(p.scheme, [(st.sample(), ws, *(() if p.post is None else (p.post[j],)))
                                                for j, (st, ws) in enumerate(p.inputs)]) for p in parts],
                                   spec=layer.weight_spec, act_scale_rule=layer.act_scale_rule, n_grid=o.grid,
                                   duo_scaling=o.duo_scaling, max_tokens=o.max_tokens)
            return res.scales, res.alpha

        return smooth_layer(layer, self.name, choose, choose_parts)


__all__ = ["AWQ", "AWQOptions", "AWQResult", "QK_NAMES", "S_MAX", "S_MIN", "awq_scales", "awq_search", "awq_search_parts"]
