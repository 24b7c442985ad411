"""GPTQ "true sequential" (``GPTQOptions.true_sequential``): within a decoder layer the Linears are
quantized stage by stage in dataflow order, each stage's Hessians recorded from the layer run with the
previous stages' Linears already quantized (GPTQ's / AutoGPTQ's ``true_sequential``).

A stage is one fused group (q/k/v, gate/up, ...; they share one outer scale and one input) or a single
Linear; stages are ordered by the first call of any of their Linears in a forward of the layer on one
calibration batch (Llama: q/k/v -> o_proj -> gate/up -> down_proj). ``quantize_model`` records the first
stage's statistics with the full-precision layer (the usual pass), quantizes and replaces it, then for
each later stage runs the layer again on every calibration input, recording only that stage's inputs.
Layers with MoE experts are refused (``check_true_sequential``).
"""
from __future__ import annotations

import torch
from torch import nn

from ....errors import QuantizationError
from ....nn.fused import fused_groups
from ...capture import run_layer


def check_true_sequential(layer: nn.Module, name: str) -> None:
    """QuantizationError naming ``name`` when ``layer`` holds MoE experts (a module named ``experts``):
    their routed per-expert stages are not supported by true-sequential GPTQ."""
    for sub, _ in layer.named_modules():
        if sub.rpartition(".")[2] == "experts":
            raise QuantizationError(f"{name}: GPTQOptions.true_sequential does not support MoE layers "
                                    f"({name}.{sub} holds experts); use true_sequential=False "
                                    "(without --gptq-true-sequential)")


@torch.no_grad()
def dataflow_stages(layer: nn.Module, linears: dict, inputs, device) -> list[list[str]]:
    """The stages of ``linears`` (full name -> nn.Linear inside ``layer``): ``fused_groups`` of their names,
    ordered by the first call of any member while ``layer`` runs on the first of ``inputs`` (ties and
    Linears never called: in ``fused_groups`` order, after the called ones). Without inputs: that order."""
    groups = fused_groups(list(linears))
    first = next(iter(inputs), None) if inputs is not None else None
    if first is None:
        return [list(g) for g in groups]
    order: dict[str, int] = {}
    handles = []
    for n, m in linears.items():
        def pre(mod, args, n=n):
            order.setdefault(n, len(order))
        handles.append(m.register_forward_pre_hook(pre))
    try:
        run_layer(layer, [first], device, keep_outputs=False)
    finally:
        for h in handles:
            h.remove()
    never = len(order)
    keyed = [(min(order.get(n, never) for n in g), i, g) for i, g in enumerate(groups)]
    return [list(g) for _, _, g in sorted(keyed)]


__all__ = ["check_true_sequential", "dataflow_stages"]
