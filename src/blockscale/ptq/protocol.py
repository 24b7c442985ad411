"""The protocol every PTQ method implements: collect statistics -> transform the layer -> quantize weights.

``quantize_model`` runs, for each decoder layer::

    stats  = record(layer, method.statistics())          # 1. forward hooks on the Linears to quantize
    alphas = method.transform_layer(LayerContext(...))   # 2. e.g. fold smoothing scales (in place)
    (stats recorded again when 2 changed the layer and W4A4 or the method needs them)
    for each fused group (one shared weight scale S) and Linear:
        q = method.quantize_weight(weight, stats[name], spec, S)   # 3. a QuantizedTensor

``spec`` is the weight format of the Linear's scheme (``recipes.Scheme.weight_spec``: NVFP4, FP8 or
MX) and ``S`` the scale its fused group shares (``ptq.scheme_quantize.group_weight_scale``: the NVFP4
outer encode scale, the FP8 per-tensor dequantization scale, None for per-channel / block FP8 and MX).

A method is a subclass of ``PTQMethod`` with a ``name``, an ``Options`` frozen dataclass (its fields made
with ``ptq.options.option``), and whichever of the steps it changes; the defaults record nothing, leave
the layer alone and round to nearest. Register it with ``ptq.methods.register_method``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from torch import nn

from ..quant import NVFP4, QuantizedTensor
from .scheme_quantize import rtn_quantize
from .statistics import InputStatistics, StatisticsRequest


@dataclass(frozen=True)
class LayerContext:
    """What ``transform_layer`` sees of one decoder layer.

    module: the decoder layer (changed in place). index: its position. linears: full name -> the
    nn.Linear to quantize. stats: full name -> its input statistics. weight_spec: the NVFP4 weight
    format of the flat config. act_scale_rule: the activations' scale rule for W4A4, None for W4A16
    (flat config). schemes: full name -> its ``recipes.Scheme`` (what each Linear becomes; None:
    every Linear is NVFP4 with ``weight_spec`` / ``act_scale_rule``; quantize_model also gives each
    fused-experts module's scheme). experts: full name -> the fused 3-D experts module of this layer to
    quantize (``ptq.fused_experts``). expert_stats: full name -> its ``ExpertStatistics``
    (``.stats["gate_up" | "down"][e]``: expert e's ``InputStatistics`` with the method's request).
    expert_outer_scale: "expert" (gate/up of one expert share an outer scale) or "tensor" (one for all
    experts' gate/up rows, one for all downs), as ``PTQConfig.expert_outer_scale``. notes:
    ``transform_layer`` appends what it left undone in a layer it handles (e.g. "self_attn.o_proj not
    smoothed: ..."; names relative to the layer); quantize_model reports each distinct one once.
    """

    module: nn.Module
    index: int
    linears: dict
    stats: dict
    weight_spec: NVFP4
    act_scale_rule: Optional[str] = None
    schemes: Optional[dict] = None
    experts: dict = field(default_factory=dict)
    expert_stats: dict = field(default_factory=dict)
    expert_outer_scale: str = "expert"
    notes: list = field(default_factory=list)


@dataclass(frozen=True)
class QuantizedWeight:
    """What ``quantize_weight`` returns: the quantized weight, and a note for the report (e.g. a fallback).
    latent: the FP32 weight whose rounding with ``q``'s scales gives ``q``'s codes when that is not the weight
    ``quantize_weight`` was given (AWQ with clipping: the clipped weight; GPTQ: the error-compensated column
    values it rounded); what ``quantize_model(latent_weights=...)`` records for scale learning."""

    q: QuantizedTensor
    note: str = ""
    latent: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class StartWeight:
    """What ``reconstruct_layer`` starts from for one Linear: ``q`` the method's own ``quantize_weight``
    result before any reconstruction (round to nearest with the scheme's scale rule and the group's shared
    scale; Hessian-aware block scales where the rule asks for them), its ``scheme`` (``recipes.Scheme``) and
    ``input_amax``: the calibrated input amax of its fused group (a static activation scale's source)."""

    q: QuantizedTensor
    scheme: object
    input_amax: float


class SolvedMethod:
    """A PTQ method whose ``quantize_weight`` answers from results solved beforehand, by statistics name
    (``InputStatistics.name``); a weight without a result (or of another shape) goes to the method itself.
    Every other attribute is the method's."""

    def __init__(self, method, results: dict):
        self._method, self._results = method, results

    def __getattr__(self, name):
        return getattr(self._method, name)

    def quantize_weight(self, weight, stats, spec, encode_scale):
        res = self._results.get(stats.name) if stats is not None else None
        if res is None or tuple(res.q.shape) != tuple(weight.shape):
            return self._method.quantize_weight(weight, stats, spec, encode_scale)
        return res


class PTQMethod:
    """One PTQ method, built from its options: ``METHODS[name](options)``.

    name: the ``PTQConfig.method`` value. Options: its options dataclass. flag_prefix: its flags are
    ``--<flag_prefix>-<field>``. calibrates: needs calibration data even for W4A16.
    quantizes_with_statistics: ``quantize_weight`` reads the statistics (so they are recorded again
    after ``transform_layer`` changed the layer). compares_to_rtn: the report also gives each Linear's
    output error under plain RTN with the same S (``LinearReport.rtn_output_rel_err``).
    quantizes_fused_experts: ``quantize_weight`` may be called per expert of a fused 3-D experts module
    (``ptq.fused_experts``); otherwise PTQ refuses models whose fused experts it would quantize.
    chooses_block_scales: ``quantize_weight`` picks each group's block scales itself (GPTQ, inside its
    error-feedback loop), so a scale rule that picks them from calibration weights cannot be combined,
    unless the method also has ``weighs_block_scales``: it then applies a Hessian-aware rule ("hessian",
    "hessian-4over6") to its own choice (``quantize_weight_weighted(weight, stats, spec, encode_scale, rule)``).
    reconstructs_layers: the method optimises a whole decoder layer's quantization at once on the layer's
    calibration inputs (``reconstruct_layer``, AutoRound); quantize_model then quantizes each Linear from
    its results.
    hessian_of_rounded_inputs: the Hessian of each Linear that quantizes its inputs (W4A4, W8A8) is recorded from
    its inputs as its quantized Linear rounds them (a second pass over the layer; GPTQ's ``rounded_inputs``).
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type]
    flag_prefix: ClassVar[str] = ""
    calibrates: ClassVar[bool] = True
    quantizes_with_statistics: ClassVar[bool] = False
    compares_to_rtn: ClassVar[bool] = False
    quantizes_fused_experts: ClassVar[bool] = False
    chooses_block_scales: ClassVar[bool] = False
    weighs_block_scales: ClassVar[bool] = False
    reconstructs_layers: ClassVar[bool] = False
    hessian_of_rounded_inputs: bool = False

    def __init__(self, options=None):
        options = self.Options() if options is None else options
        if not isinstance(options, self.Options):
            raise TypeError(f"{type(self).__name__} takes {self.Options.__name__}, got {type(options).__name__}")
        self.options = options

    @classmethod
    def resolve_options(cls, options, schemes) -> "object":
        """``options`` with every "auto" (None) switch decided for the recipe's ``schemes`` (PTQConfig calls it,
        so the config says what runs); the default: unchanged."""
        return options

    def check_layer(self, layer: nn.Module, name: str) -> None:
        """Before calibrating: a QuantizationError naming ``name`` if this method cannot handle ``layer``."""

    def check_scheme(self, name: str, scheme) -> None:
        """Before calibrating: a UsageError naming the method, the scheme and Linear ``name`` if this
        method cannot quantize it with ``scheme`` (a ``recipes.Scheme``; the built-in methods take every
        scheme)."""

    def statistics(self) -> StatisticsRequest:
        """1. What to record about each Linear's calibration inputs (beyond tokens and amax)."""
        return StatisticsRequest()

    def transform_layer(self, layer: LayerContext) -> dict[str, float]:
        """2. Change the decoder layer in place without changing its full-precision function (e.g. fold
        smoothing scales). Returns the Linears changed -> the strength used (``smoothing_alpha`` in the
        report); empty when nothing changed."""
        return {}

    def quantize_stages(self, layer: nn.Module, linears: dict, inputs, device) -> Optional[list]:
        """Optional order of step 3: None (default) quantizes every Linear of the layer from the statistics
        of step 1; a list of stages (lists of full names, fused groups kept whole) makes quantize_model
        quantize stage by stage, recording each later stage's statistics again with the earlier stages
        already quantized (GPTQ's ``true_sequential``)."""
        return None

    def reconstruct_layer(self, layer: LayerContext, inputs, device, start: dict) -> tuple[dict, dict]:
        """2b. (``reconstructs_layers`` only; after the transform, with the statistics recorded again) the
        layer's quantized weights chosen together: ``inputs`` the calibration batches at the layer's door
        (``capture.LayerInput``), ``start`` full Linear name -> ``StartWeight``. Returns (results, figures):
        statistics name -> ``QuantizedWeight`` (what ``quantize_weight`` then returns for that Linear), and
        the layer's figures for ``PTQReport.method_stats`` (a JSON-able dict)."""
        raise NotImplementedError(f"{type(self).__name__} does not reconstruct layers")

    def quantize_weight(self, weight: torch.Tensor, stats: Optional[InputStatistics], spec,
                        encode_scale: Optional[torch.Tensor]) -> QuantizedWeight:
        """3. ``weight`` [N, K] in ``spec`` (NVFP4 / FP8 / MX) with the group's shared scale (default:
        round to nearest, ``scheme_quantize.rtn_quantize``; NVFP4 with the spec's scale rule)."""
        return QuantizedWeight(rtn_quantize(weight, spec, encode_scale))


__all__ = ["LayerContext", "PTQMethod", "QuantizedWeight", "SolvedMethod", "StartWeight"]
