"""quantize_model: post-training quantization of a causal LM, one decoder layer at a time, each Linear
with its scheme from the PTQ recipe (``config.ptq_recipe``: NVFP4, FP8, MX or bf16 per module).

For each decoder layer, the method's three steps (``ptq.protocol.PTQMethod``): (1) run the layer on
the stored calibration inputs (outputs of the already quantized previous layers) and record
per-Linear statistics (input amax, and what the method asks for: Hessian, per-channel max, sampled
inputs); (2) ``transform_layer`` (AWQ / SmoothQuant: fold per-input-channel scales into the preceding
norm / linear; the full-precision function is unchanged), then re-record statistics when needed;
(3) ``quantize_weight`` for every Linear with its scheme's weight spec and the scale its fused group
shares (NVFP4 outer scale; FP8 per-tensor scale max amax / 448), replaced by the scheme's module
(``NVFP4Linear`` / ``FP8Linear`` / ``MXLinear``; static input scales from the group's calibrated
input amax); (4) with ``recipe.kv_cache``: run the quantized layer under a K/V amax observer and
attach its FP8 KV scales (``kv_calibration``); then run the quantized layer (KV fake quantization
active) to produce the next layer's inputs.

Before any of it (``preflight``): the plan of what is quantized with which scheme and what stays in
high precision (refused when that is most of the decoder weights, unless ``allow_partial``; a fused
group split between schemes is refused), finite parameters, smoothable layers, attention modules for
the KV cache, calibration ids inside the vocabulary. During it: non-finite calibration inputs of
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

from ..errors import QuantizationError, UsageError
from ..nn.fused import fused_groups
from ..nn.input_rotation import carry_input_rotation
from ..quant import NVFP4
from .capture import LayerInput, capture_first_layer_inputs, decoder_layers, run_layer
from .config import PTQConfig
from .distributed import CalibrationRanks, calibration_ranks
from .fused_experts import ExpertsReport, expert_scale_groups, experts_start, observe_experts, quantize_experts
from .kv_calibration import calibrate_kv, check_kv_layers
from .preflight import (check_calibration, check_coverage, check_experts_method, check_finite_parameters, check_layers,
                        check_method_schemes, plan_quantization)
from .rotations import rotate_model
from .protocol import LayerContext, PTQMethod, SolvedMethod, StartWeight
from .scheme_plan import unused_rule_warnings
from .scheme_modules import build_linear
from .scheme_quantize import group_weight_scale, rtn_quantize
from .statistics import InputStatistics, StatisticsRequest, collect_statistics


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
    scheme: str = ""  # the Linear's scheme label (recipes.Scheme.label), e.g. "fp8-w8a8", "nvfp4-w4a4 4over6-mse"


@dataclass
class PTQReport:
    """kept_high_precision: every decoder-layer module whose floating-point parameters of >= 2 dims stay
    in high precision (excluded Linears, fused 3-D MoE experts, routers, ...), then the Linears outside
    the decoder layers (lm_head); high_precision_elements: those decoder-layer modules -> their elements;
    high_precision_fraction: their share of all decoder-layer weight elements (0 when all are quantized);
    kv_cache (recipes with a kv_cache): {attention module: {"k_amax", "v_amax", "k_scale", "v_scale"}}
    as lists (one value per layer, or one per KV head), s = amax / 448; experts: one ``ExpertsReport``
    per fused 3-D experts module quantized (per-expert token counts: seen by its statistics and routed to
    it, errors, input amax, the outer-scale mode, notes); method_stats: one dict per decoder layer from a
    method that reconstructs layers (AutoRound: the layer's output error at its start and after, iterations,
    seconds)."""

    config: dict
    layers: int = 0
    linears: list[LinearReport] = field(default_factory=list)
    kept_high_precision: list[str] = field(default_factory=list)
    high_precision_elements: dict[str, int] = field(default_factory=dict)
    high_precision_fraction: float = 0.0
    calibration_tokens: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    kv_cache: dict[str, dict] = field(default_factory=dict)
    experts: list[ExpertsReport] = field(default_factory=list)
    method_stats: list[dict] = field(default_factory=list)  # per layer, from methods that reconstruct layers
    rotation: list[str] = field(default_factory=list)  # what ``--rotate`` did (``rotations.RotationReport.lines``)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _legacy_nvfp4(recipe) -> tuple[NVFP4, Optional[str]]:
    """``LayerContext.weight_spec`` / ``act_scale_rule``: those of the recipe's first NVFP4 scheme (the
    flat config's one scheme), else NVFP4 defaults and None."""
    nv = next((s for s in recipe.schemes() if isinstance(s.weight_spec, NVFP4)), None)
    if nv is None:
        return NVFP4(), None
    return nv.weight_spec, (nv.act_scale_rule if nv.name == "nvfp4-w4a4" else None)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    carry_input_rotation(getattr(parent, child), new)  # an online rotation (``--rotate``) stays on the module
    setattr(parent, child, new)


def _quantize_one(n: str, lin: nn.Linear, st: Optional[InputStatistics], S: Optional[torch.Tensor], in_amax: float,
                  scheme, method: PTQMethod, alpha: Optional[float], fallback_amax: float):
    """Linear ``n`` as its scheme's inference module (the method's ``quantize_weight`` with the
    group's shared weight scale S, ``scheme_quantize.group_weight_scale``) and its report."""
    w = lin.weight.detach()
    spec = scheme.weight_spec
    res = method.quantize_weight(w, st, spec, S)
    note = res.note
    if st is not None and st.tokens == 0 and scheme.static_activations:
        note = (note + "; " if note else "") + f"no calibration tokens: input amax {fallback_amax:.4g} from its layer"
    new = build_linear(res.q, lin.bias, scheme, in_amax, w.dtype)
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
            rtn_rel = out_err(rtn_quantize(w, spec, S).dequantize(torch.float32) - wf)
    new.ptq_latent = res.latent  # (a plain attribute, popped by _quantize_linears: not in any state_dict)
    return new, LinearReport(n, tuple(w.shape), st.tokens if st is not None else 0, rel, out_rel, rtn_rel,
                             st.amax if st is not None else None, alpha, note, scheme.label)


def _input_amax(group: list, stats, fallback_amax: float) -> float:
    """A fused group's calibrated input amax (the static activation scale's source): the largest of its Linears'
    with tokens, else ``fallback_amax``."""
    amaxes = [stats[n].amax for n in group if stats is not None and stats[n].tokens]
    return max(amaxes) if amaxes else fallback_amax


def _groups(linears: dict[str, nn.Linear], stats, schemes: dict, fallback_amax: float, expert_outer_scale: str):
    """(fused group, its scheme, the weight scale it shares, its calibrated input amax) for each fused group."""
    groups = fused_groups(list(linears))
    scale_group = {n: g for g in expert_scale_groups(groups, expert_outer_scale, schemes) for n in g}
    for group in groups:
        scheme = schemes[group[0]]  # one per fused group (scheme_plan.assign_schemes)
        in_amax = _input_amax(group, stats, fallback_amax)
        shared = scale_group[group[0]]  # the fused group, or every expert's (expert_outer_scale="tensor")
        try:
            S = group_weight_scale(scheme, [linears[n].weight for n in shared])
        except ValueError as err:
            raise QuantizationError(f"{', '.join(shared)}: {err}") from err
        yield group, scheme, S, in_amax


def _rounded_input_hessians(run: LayerPass, i: int, inputs, linears: dict, stats: dict, fallback: float) -> None:
    """``hessian_of_rounded_inputs``: each Linear that quantizes its inputs gets, in ``stats``, the Hessian of its
    inputs as its quantized module rounds them (its scheme's ``input_quantizer`` at its group's calibrated amax,
    the one it will be built with), from a second pass over the layer; its other statistics stay the first's."""
    rounding = {}
    for group in fused_groups(list(linears)):  # (no weight scales needed here: _groups computes them later)
        scheme = run.schemes[group[0]]
        if scheme.quantizes_activations:
            q = scheme.input_quantizer(_input_amax(group, stats, fallback))
            rounding.update({n: q for n in group if stats[n].tokens})
    if not rounding:
        note = "rounded-input Hessians: no Linear of these layers quantizes its inputs (W4A16); nothing changed"
        if note not in run.report.warnings:
            run.report.warnings.append(note)
        return
    part = {n: linears[n] for n in rounding}
    second = run.ranks.statistics(lambda: (collect_statistics(
        run.layers[i], i, inputs, part, StatisticsRequest(hessian=True), run.device, run.report.calibration_tokens,
        run.config.calibrate_all_experts, rounding=rounding), None), run.device)[0]
    for n in rounding:
        stats[n].hessian = second[n].hessian


def _start_weights(linears: dict[str, nn.Linear], stats, schemes: dict, method: PTQMethod, fallback_amax: float,
                   expert_outer_scale: str) -> dict[str, StartWeight]:
    """Each Linear's ``StartWeight`` for ``reconstruct_layer``: the method's own ``quantize_weight``."""
    start = {}
    for group, scheme, S, in_amax in _groups(linears, stats, schemes, fallback_amax, expert_outer_scale):
        for n in group:
            w = linears[n].weight.detach()
            try:
                q = method.quantize_weight(w, stats[n] if stats is not None else None, scheme.weight_spec, S).q
            except ValueError as err:
                raise QuantizationError(f"{n}: {err}") from err
            start[n] = StartWeight(q, scheme, in_amax)
    return start


def _quantize_linears(root, linears: dict[str, nn.Linear], stats, schemes: dict, method: PTQMethod,
                      report: PTQReport, alphas: dict[str, float], fallback_amax: float,
                      expert_outer_scale: str = "expert", latent: Optional[dict] = None) -> None:
    for group, scheme, S, in_amax in _groups(linears, stats, schemes, fallback_amax, expert_outer_scale):
        for n in group:
            st = stats[n] if stats is not None else None
            try:
                new, lr = _quantize_one(n, linears[n], st, S, in_amax, scheme, method, alphas.get(n), fallback_amax)
            except QuantizationError:
                raise
            except ValueError as err:  # every failure names the Linear it happened in
                raise QuantizationError(f"{n}: {err}") from err
            report.linears.append(lr)
            given = new.__dict__.pop("ptq_latent", None)
            if latent is not None:  # the method's latent, else the weight quantize_weight was given (after its transform)
                w = given if given is not None else linears[n].weight
                latent[n] = w.detach().float().cpu().clone()
            _replace(root, n, new)


def _preflight(model: nn.Module, layers: nn.ModuleList, prefix: str, config: PTQConfig, calibration,
               report: PTQReport, check_finite: bool = True) -> tuple[list[dict[str, nn.Linear]], dict, int, list]:
    """Everything checked before calibrating; fills the report's high-precision fields and warns once
    about them. Returns the Linears to quantize per layer, their schemes and how many report.warnings
    were warned, and the fused-experts modules to quantize per layer."""
    plan = plan_quantization(model, layers, prefix, config)
    report.kept_high_precision = plan.kept_high_precision
    report.high_precision_elements = dict(plan.coverage.high_precision)
    report.high_precision_fraction = plan.coverage.high_precision_fraction
    line = check_coverage(plan.coverage, config, plan.kept_by_recipe)  # raises when most would stay high precision
    if check_finite:  # (False: layers on the meta device; streaming checks each one once loaded)
        check_finite_parameters(layers, prefix)
        check_layers(layers, prefix, config)
    check_method_schemes(config.make_method(), plan.schemes)
    check_experts_method(config.make_method(), plan.experts)
    if config.ptq_recipe.kv_cache is not None:
        check_kv_layers(layers, prefix)
    if config.needs_calibration:
        check_calibration(model, calibration, config)
    for rule_line in unused_rule_warnings(config.ptq_recipe, plan.used_rules):
        warnings.warn(rule_line, UserWarning, stacklevel=4)
        report.warnings.append(rule_line)
    if line is not None:
        warnings.warn(line, RuntimeWarning, stacklevel=4)
        report.warnings.append(line)
    warned = len(report.warnings)
    report.warnings.extend(plan.warnings)
    return plan.per_layer, plan.schemes, warned, plan.experts


def quantize_model(model: nn.Module, config: PTQConfig, calibration: Optional[torch.Tensor] = None, *,
                   device=None, progress: bool = True, data_parallel: Optional[bool] = None,
                   latent_weights: Optional[dict] = None) -> PTQReport:
    """Quantize ``model`` (a transformers causal LM, or any model whose decoder layers form one
    ModuleList) in place: every nn.Linear inside the decoder layers, except the recipe's ignore list
    (``config.exclude`` for the flat config) and its "bf16" Linears, becomes its scheme's module
    (``scheme_plan.assign_schemes``): NVFP4Linear, FP8Linear or MXLinear; every fused 3-D experts module
    (transformers >= 5 Mixtral / Qwen-MoE / OLMoE ``mlp.experts``) becomes an ``NVFP4Experts`` (NVFP4
    schemes; per-expert statistics, ``config.calibrate_all_experts`` / ``expert_outer_scale``;
    ``ptq.fused_experts``). ``calibration``: [n, T]
    token ids (needed unless the method is RTN and no scheme has static activations nor the recipe a
    KV cache). ``device``: where each layer is processed (default: where the model is).
    ``data_parallel``: inside a torch.distributed process group of several ranks (torchrun), each rank
    calibrates on its share of the calibration batches and the statistics are reduced over ranks
    (``ptq.distributed``; None: whenever such a group is initialized, False: never, True: required).
    Returns a report (per-linear errors and scheme, what stays in high precision, KV scales, time).
    ``latent_weights``: a dict filled with {Linear name: the FP32 (CPU) weight its quantization was given,
    i.e. after the method's transform (AWQ / SmoothQuant folding)}: the latent weights scale learning can
    start from (``lsq.exact_latent_weights`` keeps those that reproduce the stored codes).

    Before calibrating, raises QuantizationError when more than half of the decoder layers' weight
    elements would stay in high precision (excluded experts, ...) unless ``config.allow_partial``
    (then one RuntimeWarning says what share stays), when a recipe splits a fused group between schemes,
    when in_features does not fit a scheme's blocks (unless ``skip_indivisible``), when a decoder-layer
    parameter is NaN/inf, when AWQ / SmoothQuant cannot fold into a layer, or when the recipe's KV cache
    finds no attention module in a layer; DataError for calibration ids outside the vocabulary or
    an empty calibration set. While calibrating, DataError when a Linear's inputs are NaN/inf."""
    t0 = time.time()
    run = start_pass(model, config, calibration, device, data_parallel=data_parallel)
    run.latent = latent_weights
    inputs = first_inputs(run, calibration)
    it = range(len(run.layers))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"PTQ {config.label}", unit="layer")
    for i in it:
        inputs = quantize_layer(run, i, inputs)
    return finish_pass(run, t0)


@dataclass
class LayerPass:
    """What ``quantize_model`` carries from one decoder layer to the next (``start_pass`` makes it after the
    preflight; ``quantize_layer`` quantizes one layer; ``finish_pass`` closes the report). Streaming PTQ
    (``ptq.streaming``) drives the same three steps with each layer loaded only while it is processed."""

    model: nn.Module
    layers: nn.ModuleList
    prefix: str
    config: PTQConfig
    method: PTQMethod
    request: object
    spec: NVFP4
    act_rule: Optional[str]
    report: PTQReport
    per_layer: list
    per_layer_experts: list
    schemes: dict
    warned: int
    home: torch.device
    device: torch.device
    ranks: CalibrationRanks = field(default_factory=CalibrationRanks)  # data-parallel calibration (ptq.distributed)
    latent: Optional[dict] = None  # quantize_model(latent_weights=...): filled with each Linear's quantized weight


def start_pass(model: nn.Module, config: PTQConfig, calibration, device=None, *, check_finite: bool = True,
               data_parallel: Optional[bool] = None) -> LayerPass:
    """Checks (``_preflight``) and the pass state. ``check_finite=False``: the decoder layers' parameters
    are not read (on the meta device: the caller checks each layer with ``finite.check_finite_parameters``
    and ``preflight.check_layers`` once it is loaded)."""
    if not isinstance(config, PTQConfig):
        raise TypeError(f"config must be a PTQConfig, got {type(config).__name__}")
    recipe = config.ptq_recipe
    spec, act_rule = _legacy_nvfp4(recipe)
    method = config.make_method()
    report = PTQReport(config=config.to_dict())
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    home = next(model.parameters()).device
    if home.type == "meta":
        home = torch.device("cpu")
    device = torch.device(device) if device is not None else home
    ranks = calibration_ranks(data_parallel)
    if ranks.enabled and method.reconstructs_layers:
        raise UsageError(f"method={config.method!r} optimises each decoder layer on all calibration batches at once "
                         "and does not run data-parallel yet: run it in one process (without torchrun)")
    checks = (model, layers, prefix, config, calibration, report, check_finite)  # synced: one rank fails, all do
    per_layer, schemes, warned, per_layer_experts = ranks.synced(_preflight, *checks) if ranks.enabled else \
        _preflight(*checks)
    report.layers = len(layers)
    plan = config.rotation_plan
    if plan.any:  # after the checks (which read the unrotated model), before any statistics
        if not check_finite:
            raise UsageError(f"rotate={plan.label!r} needs the whole model in memory (R1 rotates the embeddings and "
                             "lm_head): run without streaming (--no-streaming)")
        report.rotation = rotate_model(model, plan, schemes).lines()
        if plan.r3 and config.ptq_recipe.kv_cache is None:
            msg = (f"rotate={plan.label!r}: R3 rotates queries and keys for the KV cache's key quantization, and this "
                   "recipe has no kv_cache: it changes nothing (a recipe with kv_cache, e.g. nvfp4-experts-fp8-attention)")
            warnings.warn(msg, UserWarning, stacklevel=3)
            report.warnings.insert(warned, msg)  # (warned now: not repeated in finish_pass's summary)
            warned += 1
    return LayerPass(model, layers, prefix, config, method, method.statistics(), spec, act_rule, report, per_layer,
                     per_layer_experts, schemes, warned, home, device, ranks)


def first_inputs(run: LayerPass, calibration) -> Optional[list[LayerInput]]:
    """The calibration batches at the first decoder layer's door (on ``run.device``), or None without calibration."""
    if not run.config.needs_calibration:
        return None
    batches = run.ranks.shard(list(calibration.split(run.config.batch_size)), calibration,  # this rank's share
                              run.model)  # (every rank must hold the same model: checked)
    run.report.calibration_tokens = calibration.numel()
    inputs = capture_first_layer_inputs(run.model, run.layers, batches)
    return [LayerInput(i.hidden.to(run.device), i.args, i.kwargs) for i in inputs]


def quantize_layer(run: LayerPass, i: int, inputs, advance=run_layer):
    """Decoder layer ``i``: statistics, the method's transform, quantized modules, KV scales; returns the
    next layer's inputs (``advance(layer, inputs, device)``, default ``capture.run_layer``; the inputs
    unchanged after the last layer or without calibration)."""
    model, config, report, method, device = run.model, run.config, run.report, run.method, run.device
    schemes, request, prefix, recipe = run.schemes, run.request, run.prefix, config.ptq_recipe
    layer = run.layers[i]
    layer.to(device)
    linears, experts = run.per_layer[i], run.per_layer_experts[i]
    stats, alphas, ex_stats = None, {}, None
    if inputs is not None and (linears or experts):
        def record():
            with observe_experts(experts, i, report.calibration_tokens, device, request,
                                 config.calibrate_all_experts) as ex:
                st = collect_statistics(layer, i, inputs, linears, request, device, report.calibration_tokens,
                                        config.calibrate_all_experts)
            return st, ex

        stats, ex_stats = run.ranks.statistics(record, device)  # reduced over ranks (data-parallel)
        ctx = LayerContext(layer, i, linears, stats, run.spec, run.act_rule,
                           {n: schemes[n] for n in [*linears, *experts]}, experts, ex_stats or {},
                           config.expert_outer_scale)
        with torch.no_grad():
            alphas = method.transform_layer(ctx)
        for note in ctx.notes:  # e.g. a group the method leaves alone in every MLA layer: said once
            line = f"{prefix}.*.{note}"
            if line not in report.warnings:
                report.warnings.append(line)
        static = any(schemes[n].static_activations for n in [*linears, *experts])
        if alphas and (static or method.quantizes_with_statistics):
            stats, ex_stats = run.ranks.statistics(record, device)
    fallback = max([s.amax for s in stats.values() if s.tokens], default=1.0) if stats else 1.0
    if stats and method.hessian_of_rounded_inputs:
        _rounded_input_hessians(run, i, inputs, linears, stats, fallback)
    if method.reconstructs_layers and inputs is not None and (linears or experts):  # AutoRound: all at once
        start = _start_weights(linears, stats, schemes, method, fallback, config.expert_outer_scale)
        for name, module in experts.items():  # fused 3-D experts: every expert's projections
            est = (ex_stats or {}).get(name)
            if est is not None:
                try:
                    start[name] = experts_start(module, schemes[name], method, est, fallback, config.expert_outer_scale)
                except ValueError as err:
                    raise QuantizationError(f"{name}: {err}") from err
        ctx = LayerContext(layer, i, linears, stats, run.spec, run.act_rule, ctx.schemes, experts, ex_stats or {},
                           config.expert_outer_scale)
        results, figures = method.reconstruct_layer(ctx, inputs, device, start)
        report.method_stats.append({"layer": i, **figures})
        method = SolvedMethod(method, results)
    stages = method.quantize_stages(layer, linears, inputs, device) if inputs is not None and linears else None
    if stages is not None and run.ranks.enabled:  # every rank takes the last rank's order (it has a batch)
        stages = run.ranks._gather_objects(stages)[-1]
    with torch.no_grad():  # data-parallel: GPTQ's solves spread over the ranks (ptq.distributed)
        for k, names in enumerate(stages if stages is not None else [list(linears)]):
            part = {n: linears[n] for n in names}
            if k:  # true sequential: this stage's inputs with the earlier stages quantized (in place)
                stats = {**stats, **run.ranks.statistics(lambda: (collect_statistics(
                    layer, i, inputs, part, request, device, report.calibration_tokens,
                    config.calibrate_all_experts), None), device)[0]}
            solver = run.ranks.solver(method, model, part, experts if k == 0 else {}, stats, ex_stats if k == 0
                                      else None, schemes, config.expert_outer_scale, latent=run.latent is not None)
            _quantize_linears(model, part, stats, schemes, solver, report, alphas, fallback,
                              config.expert_outer_scale, run.latent)
        quantize_experts(model, experts, ex_stats, schemes, solver, report.experts, report.warnings, fallback,
                         config.expert_outer_scale)
    if recipe.kv_cache is not None and inputs is not None:
        entries, kv_notes = calibrate_kv(layer, f"{prefix}.{i}", inputs, device, recipe.kv_cache.per_head,
                                         reduce=run.ranks.kv_amax, format=recipe.kv_cache.format)
        report.kv_cache.update(entries)
        report.warnings.extend(kv_notes)
    if inputs is not None and i + 1 < len(run.layers):
        inputs = advance(layer, inputs, device)
    layer.to(run.home)
    for lr in report.linears[-len(linears):] if linears else []:
        if lr.note:
            report.warnings.append(f"{lr.name}: {lr.note}")
    return inputs


def finish_pass(run: LayerPass, t0: float) -> PTQReport:
    """The one warning for the whole model and the time; returns the report."""
    report = run.report
    notes = report.warnings[run.warned:]
    if notes:  # one warning for the whole model, each case listed
        warnings.warn(f"{len(notes)} layer(s) need attention (see report.warnings): "
                      + "; ".join(notes[:4]) + ("; ..." if len(notes) > 4 else ""), RuntimeWarning, stacklevel=3)
    report.seconds = time.time() - t0
    return report


__all__ = ["LayerPass", "LinearReport", "PTQReport", "finish_pass", "first_inputs", "quantize_layer", "quantize_model",
           "start_pass"]
