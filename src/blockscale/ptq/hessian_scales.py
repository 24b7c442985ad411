"""PTQ scale rules "hessian" and "hessian-4over6": NVFP4 weight block scales chosen by the output error
weighted with the diagonal of the Linear's calibration input second moments (``quant.nvfp4.weighted``).

``PTQConfig.make_method`` wraps the method in ``HessianScales`` when a scheme of the recipe has such a rule:

- statistics: the method's request plus ``channel_sqsum`` (per input channel sum of x^2 of the inputs the
  Linear sees; recorded again after ``transform_layer``, so with AWQ / SmoothQuant d is of the smoothed
  inputs the quantized Linear actually sees); fused 3-D experts: one d per expert and projection
  (``ExpertStatistics``), the routed tokens (or all of them with ``calibrate_all_experts``).
- quantize_weight: for a Linear (or expert projection) whose scheme has a Hessian-aware rule,
  ``quantize_weighted(W, rule, S, d)`` with the group's shared outer scale S (fused groups keep one S) and
  d = mean x^2 per channel; no calibration token: the base rule ("sweep" / "4over6") and a note. Every
  other weight: the method's own ``quantize_weight``.
- methods that choose the block scales themselves and weigh them (``weighs_block_scales``, GPTQ: its
  error-feedback loop picks each group's scales from the current weights, with the rule's weighted error):
  ``quantize_weight_weighted(weight, stats, spec, S, rule)``.
- refused (UsageError, before calibrating): methods that choose the block scales themselves without
  weighing them; AWQ with ``clip`` (its clipped weights are rounded by the clip search's own rule).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import UsageError
from ..quant.nvfp4.weighted import quantize_weighted
from .methods import METHODS
from .protocol import QuantizedWeight
from .statistics import StatisticsRequest

_EXPERT = " (expert "  # ExpertStatistics names: "<module> (expert e, <proj> input)"


class HessianScales:
    """``method`` with Hessian-aware NVFP4 block scales for the schemes that ask for them (see the module
    docstring); every other attribute is the method's."""

    quantizes_with_statistics = True  # d is read at quantize time, recorded after the transform
    calibrates = True

    def __init__(self, method):
        self._method = method
        self._rules: dict[str, str] = {}

    def __getattr__(self, name):
        return getattr(self._method, name)

    @property
    def method(self):
        """The wrapped method."""
        return self._method

    def check_scheme(self, name: str, scheme) -> None:
        self._method.check_scheme(name, scheme)
        if not getattr(scheme, "hessian_scales", False):
            return
        m = self._method
        if m.chooses_block_scales and not m.weighs_block_scales:
            who = type(m).__name__
            others = " / ".join(n for n, cls in METHODS.items() if not cls.chooses_block_scales)
            raise UsageError(f"{name}: scale_rule={scheme.scale_rule!r} cannot be combined with method={m.name!r} ({who} "
                             "chooses each group's block scales inside its error-feedback loop, weighted by its own "
                             f"Hessian); use scale_rule 'sweep' or '4over6' with {who}, or {others} with "
                             f"{scheme.scale_rule!r}")
        if getattr(m, "clip", False):
            raise UsageError(f"{name}: scale_rule={scheme.scale_rule!r} cannot be combined with {m.name} clip (the "
                             "clip search rounds the clipped weights with its own rule); turn clip off or use another "
                             "scale rule")

    def statistics(self) -> StatisticsRequest:
        return dataclasses.replace(self._method.statistics(), channel_sqsum=True)

    def transform_layer(self, layer) -> dict:
        self._rules = {n: s.scale_rule for n, s in (layer.schemes or {}).items()
                       if getattr(s, "hessian_scales", False)}
        return self._method.transform_layer(layer)

    def _rule(self, stats) -> Optional[str]:
        if stats is None:
            return None
        name = stats.name
        if name in self._rules:
            return self._rules[name]
        return self._rules.get(name.split(_EXPERT, 1)[0]) if _EXPERT in name else None

    def quantize_weight(self, weight, stats, spec, encode_scale) -> QuantizedWeight:
        rule = self._rule(stats)
        if rule is None:
            return self._method.quantize_weight(weight, stats, spec, encode_scale)
        if self._method.weighs_block_scales:  # GPTQ: the rule inside its own loop
            return self._method.quantize_weight_weighted(weight, stats, spec, encode_scale, rule)
        d = stats.channel_weights()
        if d is None:
            res = self._method.quantize_weight(weight, stats, spec, encode_scale)
            return QuantizedWeight(res.q, (res.note + "; " if res.note else "")
                                   + f"no calibration tokens: {rule} fell back to {spec.scale_rule}")
        return QuantizedWeight(quantize_weighted(weight, rule, encode_scale, d.to(weight.device)))


__all__ = ["HessianScales"]
