"""Layer-by-layer calibration plumbing: find the decoder layers, catch the inputs of the first one,
and run one layer at a time on stored inputs (so a device holds one layer plus activations)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import QuantizationError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList of same-class blocks (not bare Linears,
    which would be a list of experts) holding the most Linear layers (``model.model.layers`` for
    transformers Llama / Mistral / Qwen ...)."""
    best, best_count = None, 0
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1 \
                and not isinstance(mod[0], nn.Linear):
            count = sum(isinstance(m, nn.Linear) for m in mod.modules())
            if count > best_count:
                best, best_count = mod, count
    if best is None:
        raise QuantizationError(f"{type(model).__name__}: found no list of decoder layers with Linear layers to "
                                "quantize")
    return best


class _Stop(Exception):
    pass


@dataclass
class LayerInput:
    """One calibration batch at a layer's door: the hidden states and the other call arguments."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict[str, Any]


def to_device(obj, device):
    """``obj`` (a tensor, or tuples / lists / dicts of them) on ``device``; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor]) -> list[LayerInput]:
    """Run the model up to its first decoder layer for every batch of token ids; keep what it receives."""
    caught: list[LayerInput] = []

    def hook(_mod, args, kwargs):
        if args:
            hidden, rest = args[0], tuple(args[1:])
        else:
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values", "use_cache")}
        caught.append(LayerInput(hidden, rest, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        device = next(model.parameters()).device
        for ids in batches:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
            except TypeError:  # not a transformers model: plain forward(idx)
                try:
                    model(ids.to(device))
                except _Stop:
                    pass
    finally:
        handle.remove()
    if len(caught) != len(batches):
        raise QuantizationError(f"caught {len(caught)} of {len(batches)} inputs of the first decoder layer: "
                                "does the model call its layers in order?")
    return caught


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list[LayerInput], device, keep_outputs: bool = True) -> list[LayerInput]:
    """The layer applied to every stored input (on ``device``); outputs become the next layer's inputs.
    ``keep_outputs=False``: run for the hooks' sake only (statistics, KV amax): each output is dropped at
    once, so at most one batch's output is alive (the inputs may be read from disk one at a time); returns []."""
    outs = []
    for inp in inputs:
        y = layer(to_device(inp.hidden, device), *to_device(inp.args, device), **to_device(inp.kwargs, device))
        if not keep_outputs:
            del y
            continue
        if isinstance(y, (tuple, list)):
            y = y[0]
        outs.append(LayerInput(y.to(inp.hidden.device), inp.args, inp.kwargs))
    return outs


__all__ = ["LayerInput", "capture_first_layer_inputs", "decoder_layers", "run_layer", "to_device"]
