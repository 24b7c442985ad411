"""What a scheme costs a unit: stored bits per weight, and the effective bits of an assignment.

A quantized [N, K] Linear stores the buffers its inference module holds under checkpoint names
(``nn.quantized_linear.weight_buffers``: codes, block / tensor scales, NVFP4's FP32 outer scale); the same count
``export.export_plan.bits_per_weight`` reports for a written checkpoint. So, per weight:

    nvfp4-w4a4 / -w4a16   4 + 8/16 = 4.5, + 32 / (N K) for the FP32 outer scale
    mxfp8                 8 + 8/32 = 8.25
    fp8-w8a8              8 + 32 / (N K) (one FP32 scale per tensor; "channel" weights: 8 + 32 / K)
    bf16                  16 (``HIGH_PRECISION_BITS``: what a bf16 checkpoint stores; a float32 one stores 32)

Activation (input) scales are not weights and are not counted. A unit's bits are the sum over the Linears a
checkpoint stores for it (fused experts: gate, up and down of every expert).

Effective bits of an assignment = sum over units of w_u * bits_u / params_u, divided by sum of w_u, where w_u is
the unit's parameter count ("total") or the parameters an average token uses ("active": a dense unit all of
its parameters; an experts unit its parameters times the measured share of (token, expert) routings, i.e.
sum_e (tokens routed to e / calibration tokens) * params_e).
"""
from __future__ import annotations

import math

import torch

from ...nn.quantized_linear import weight_buffers

HIGH_PRECISION_BITS = 16
COSTS = ("total", "active")


def stored_bits(scheme, out_features: int, in_features: int) -> int:
    """Bits an [out, in] Linear under ``scheme`` (a ``recipes.Scheme``) stores for its weight, scales included."""
    spec = scheme.weight_spec
    if spec is None:
        return HIGH_PRECISION_BITS * out_features * in_features
    total = 0
    for _field, shape, dtype in weight_buffers(spec, out_features, in_features).values():
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size() * 8
    return total


def bits_per_weight(scheme, out_features: int, in_features: int) -> float:
    """``stored_bits`` per weight element of an [out, in] Linear."""
    return stored_bits(scheme, out_features, in_features) / (out_features * in_features)


def unit_bits(unit, scheme) -> int:
    """Stored bits of every Linear of ``unit`` (a ``units.Unit``) under ``scheme``."""
    return sum(count * stored_bits(scheme, n, k) for count, n, k in unit.matrices)


def unit_weights(units, active_fraction, cost: str) -> list[float]:
    """Each unit's parameter count as the budget counts it: its parameters ("total") or its parameters times
    ``active_fraction[u]`` (the share an average token uses: 1 for dense units; "active")."""
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r}; allowed values: {', '.join(map(repr, COSTS))}")
    if cost == "total":
        return [float(u.params) for u in units]
    return [u.params * f for u, f in zip(units, active_fraction)]


def cost_table(units, candidates, weights, allowed) -> list[list[float]]:
    """[unit][candidate]: the unit's share of the effective bits under that candidate (``w_u * bits_u / params_u
    / sum w``), ``math.inf`` where ``allowed[u][c]`` is False. The effective bits of an assignment are the sum
    of its entries."""
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("the units' weights sum to 0: no parameter counts towards the budget")
    return [[w * unit_bits(u, s) / u.params / total if ok else math.inf for s, ok in zip(candidates, row)]
            for u, w, row in zip(units, weights, allowed)]


def effective_bits(units, schemes, weights) -> float:
    """Effective bits per weight of ``units`` under ``schemes`` (one per unit), each unit counted by ``weights``:
    the sum of the assignment's ``cost_table`` entries, term for term."""
    total = math.fsum(weights)
    return math.fsum(w * unit_bits(u, s) / u.params / total for u, s, w in zip(units, schemes, weights))


__all__ = ["COSTS", "HIGH_PRECISION_BITS", "bits_per_weight", "cost_table", "effective_bits", "stored_bits",
           "unit_bits", "unit_weights"]
