"""quantize_model: post-training quantization of a causal LM to NVFP4, one decoder layer at a time.

For each decoder layer, the method's three steps (``ptq.protocol.PTQMethod``): (1) run the layer on
the stored calibration inputs (outputs of the already quantized previous layers) and record
per-Linear statistics (input amax, and what the method asks for: Hessian, per-channel max, sampled
inputs); (2) ``transform_layer`` (AWQ / SmoothQuant: fold per-input-channel scales into the preceding
norm / linear; the full-precision function is unchanged), then re-record statistics when needed;
(3) ``quantize_weight`` for every Linear with one outer scale per fused group, replaced by an
``NVFP4Linear``; then run the quantized layer to produce the next layer's inputs.

Before any of it (``preflight``): the plan of what is quantized and what stays in high precision
(refused when that is most of the decoder weights, unless ``allow_partial``), finite parameters,
smoothable layers, calibration ids inside the vocabulary. During it: non-finite calibration inputs of
a Linear are a ``DataError`` naming it; any failure quantizing one Linear a ``QuantizationError``
prefixed by its name.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import QuantizationError
from ..nn.fused import fused_groups
from ..nn.nvfp4_linear import NVFP4Linear
from ..quant import NVFP4, quantize
from ..quant.nvfp4 import input_encode_scale, shared_outer_scale
from .capture import LayerInput, capture_first_layer_inputs, decoder_layers, run_layer
from .config import PTQConfig
from .preflight import check_calibration, check_coverage, check_finite_parameters, check_layers, plan_quantization
from .protocol import LayerContext, PTQMethod
from .statistics import InputStatistics, collect_statistics


@dataclass
class LinearReport:
    name: str
    shape: tuple[int, int]
    tokens: int
    weight_rel_mse: float
    output_rel_err: Optional[float] = None  # tr(dW H dW^T) / tr(W H W^T) on the calibration inputs
    rtn_output_rel_err: Optional[float] = None  # the same for RTN with the same scale rule and S (GPTQ only)
    input_amax: Optional[float] = None
    smoothing_alpha: Optional[float] = None
    note: str = ""


@dataclass
class PTQReport:
    """kept_high_precision: every decoder-layer module whose floating-point parameters of >= 2 dims stay
    in high precision (excluded Linears, fused 3-D MoE experts, routers, ...), then the Linears outside
    the decoder layers (lm_head); high_precision_elements: those decoder-layer modules -> their elements;
    high_precision_fraction: their share of all decoder-layer weight elements (0 when all are NVFP4)."""

    config: dict
    layers: int = 0
    linears: list[LinearReport] = field(default_factory=list)
    kept_high_precision: list[str] = field(default_factory=list)
    high_precision_elements: dict[str, int] = field(default_factory=dict)
    high_precision_fraction: float = 0.0
    calibration_tokens: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _quantize_one(n: str, lin: nn.Linear, st: Optional[InputStatistics], S: torch.Tensor, in_amax: float,
                  cfg: PTQConfig, method: PTQMethod, spec: NVFP4, alpha: Optional[float], fallback_amax: float):
    """Linear ``n`` as an NVFP4Linear (the method's ``quantize_weight`` with the group's outer scale S)
    and its report."""
    w = lin.weight.detach()
    res = method.quantize_weight(w, st, spec, S)
    note = res.note
    if st is not None and st.tokens == 0 and cfg.activations == "w4a4":
        note = (note + "; " if note else "") + f"no calibration tokens: input amax {fallback_amax:.4g} from its layer"
    kw = {}
    if cfg.activations == "w4a4":
        kw = dict(input_global_scale=input_encode_scale(in_amax, cfg.act_scale_rule),
                  input_scale_rule=cfg.act_scale_rule, input_error=cfg.error)
    new = NVFP4Linear.from_quantized(res.q, lin.bias, dtype=w.dtype, **kw)
    wf = w.float()
    dw = new.dequantized_weight(torch.float32) - wf
    rel = float(dw.pow(2).sum() / wf.pow(2).sum().clamp_min(1e-30))
    out_rel = rtn_rel = None
    H = st.H if st is not None else None
    if H is not None:
        def out_err(d):
            return float(((d @ H) * d).sum() / ((wf @ H) * wf).sum().clamp_min(1e-30))

        out_rel = out_err(dw)
        if method.compares_to_rtn:
            rtn_rel = out_err(quantize(w, spec, encode_scale=S).dequantize(torch.float32) - wf)
    return new, LinearReport(n, tuple(w.shape), st.tokens if st is not None else 0, rel, out_rel, rtn_rel,
                             st.amax if st is not None else None, alpha, note)


def _quantize_linears(root, linears: dict[str, nn.Linear], stats, cfg: PTQConfig, method: PTQMethod, spec: NVFP4,
                      report: PTQReport, alphas: dict[str, float], fallback_amax: float) -> None:
    for group in fused_groups(list(linears)):
        amaxes = [stats[n].amax for n in group if stats is not None and stats[n].tokens]
        in_amax = max(amaxes) if amaxes else fallback_amax
        try:
            S = shared_outer_scale([linears[n].weight for n in group], spec.outer_bound)
        except ValueError as err:
            raise QuantizationError(f"{', '.join(group)}: {err}") from err
        for n in group:
            st = stats[n] if stats is not None else None
            try:
                new, lr = _quantize_one(n, linears[n], st, S, in_amax, cfg, method, spec, alphas.get(n), fallback_amax)
            except QuantizationError:
                raise
            except ValueError as err:  # every failure names the Linear it happened in
                raise QuantizationError(f"{n}: {err}") from err
            report.linears.append(lr)
            _replace(root, n, new)


def _preflight(model: nn.Module, layers: nn.ModuleList, prefix: str, config: PTQConfig, calibration,
               report: PTQReport) -> tuple[list[dict[str, nn.Linear]], int]:
    """Everything checked before calibrating; fills the report's high-precision fields and warns once
    about them. Returns the Linears to quantize per layer and how many report.warnings were warned."""
    plan = plan_quantization(model, layers, prefix, config)
    report.kept_high_precision = plan.kept_high_precision
    report.high_precision_elements = dict(plan.coverage.high_precision)
    report.high_precision_fraction = plan.coverage.high_precision_fraction
    line = check_coverage(plan.coverage, config)  # raises when most of it would stay high precision
    check_finite_parameters(layers, prefix)
    check_layers(layers, prefix, config)
    if config.needs_calibration:
        check_calibration(model, calibration, config)
    if line is not None:
        warnings.warn(line, RuntimeWarning, stacklevel=3)
        report.warnings.append(line)
    warned = len(report.warnings)
    report.warnings.extend(plan.warnings)
    return plan.per_layer, warned


def quantize_model(model: nn.Module, config: PTQConfig, calibration: Optional[torch.Tensor] = None, *,
                   device=None, progress: bool = True) -> PTQReport:
    """Quantize ``model`` (a transformers causal LM, or any model whose decoder layers form one
    ModuleList) in place: every nn.Linear inside the decoder layers, except ``config.exclude``,
    becomes an ``NVFP4Linear``. ``calibration``: [n, T] token ids (needed unless the method is RTN
    with W4A16). ``device``: where each layer is processed (default: where the model is).
    Returns a report (per-linear errors, what stays in high precision, time).

    Before calibrating, raises QuantizationError when more than half of the decoder layers' weight
    elements would stay in high precision (fused 3-D MoE experts, ...) unless ``config.allow_partial``
    (then one RuntimeWarning says what share stays), when a decoder-layer parameter is NaN/inf, or when
    AWQ / SmoothQuant cannot fold into a layer; DataError for calibration ids outside the vocabulary or
    an empty calibration set. While calibrating, DataError when a Linear's inputs are NaN/inf."""
    t0 = time.time()
    if not isinstance(config, PTQConfig):
        raise TypeError(f"config must be a PTQConfig, got {type(config).__name__}")
    spec = config.weight_spec
    method = config.make_method()
    request = method.statistics()
    act_rule = config.act_scale_rule if config.activations == "w4a4" else None
    report = PTQReport(config=config.to_dict())
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    home = next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    per_layer, warned = _preflight(model, layers, prefix, config, calibration, report)
    report.layers = len(layers)

    inputs: Optional[list[LayerInput]] = None
    if config.needs_calibration:
        batches = list(calibration.split(config.batch_size))
        report.calibration_tokens = calibration.numel()
        inputs = capture_first_layer_inputs(model, layers, batches)
        inputs = [LayerInput(i.hidden.to(device), i.args, i.kwargs) for i in inputs]

    it = range(len(layers))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"PTQ {config.label}", unit="layer")
    for i in it:
        layer = layers[i]
        layer.to(device)
        linears = per_layer[i]
        stats, alphas = None, {}
        if inputs is not None and linears:
            def record():
                return collect_statistics(layer, i, inputs, linears, request, device, report.calibration_tokens)

            stats = record()
            with torch.no_grad():
                alphas = method.transform_layer(LayerContext(layer, i, linears, stats, spec, act_rule))
            if alphas and (config.activations == "w4a4" or method.quantizes_with_statistics):
                stats = record()
        fallback = max([s.amax for s in stats.values() if s.tokens], default=1.0) if stats else 1.0
        with torch.no_grad():
            _quantize_linears(model, linears, stats, config, method, spec, report, alphas, fallback)
        if inputs is not None and i + 1 < len(layers):
            inputs = run_layer(layer, inputs, device)
        layer.to(home)
        for lr in report.linears[-len(linears):] if linears else []:
            if lr.note:
                report.warnings.append(f"{lr.name}: {lr.note}")
    notes = report.warnings[warned:]
    if notes:  # one warning for the whole model, each case listed
        warnings.warn(f"{len(notes)} layer(s) need attention (see report.warnings): "
                      + "; ".join(notes[:4]) + ("; ..." if len(notes) > 4 else ""), RuntimeWarning, stacklevel=2)
    report.seconds = time.time() - t0
    return report


__all__ = ["LinearReport", "PTQReport", "quantize_model"]
