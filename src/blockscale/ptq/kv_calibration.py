"""FP8 KV-cache calibration of one decoder layer during PTQ (``PTQRecipe.kv_cache``).

After the layer's Linears are quantized, the quantized layer runs on the stored calibration inputs
under ``nn.kv_cache.observe_kv``: the post-RoPE K / V amax of each attention module (one per layer, or
one per KV head with ``per_head``) gives ``s = amax / 448`` (``kv_scale_from_amax``; 1 where amax is
0), attached with ``set_kv_scales``. The next layer's inputs are then computed with the KV fake
quantization active, so later layers calibrate on what a server computes.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantizationError
from ..nn.kv_cache import attention_modules, kv_scale_from_amax, observe_kv, set_kv_scales
from .capture import run_layer


def layer_attention(layer: nn.Module, lprefix: str) -> dict[str, nn.Module]:
    """{full name: attention module} of one decoder layer (``nn.kv_cache.attention_modules``)."""
    return {f"{lprefix}.{n}" if n else lprefix: m for n, m in attention_modules(layer).items()}


def check_kv_layers(layers: nn.ModuleList, prefix: str) -> None:
    """Before calibrating: every decoder layer needs an attention module the KV hook understands."""
    for i, layer in enumerate(layers):
        if not attention_modules(layer):
            raise QuantizationError(f"{prefix}.{i}: the recipe's kv_cache needs an attention module (one with "
                                    "k_proj and v_proj children and a layer_idx, as transformers' attention) "
                                    "in every decoder layer; found none here (use a recipe without kv_cache)")


def calibrate_kv(layer: nn.Module, lprefix: str, inputs, device, per_head: bool,
                 reduce=None, format: str = "fp8-e4m3") -> tuple[dict, list[str]]:
    """Observe the layer's post-RoPE K / V on ``inputs`` and attach the scales. Returns (report
    entries {attn name: {"k_amax", "v_amax", "k_scale", "v_scale"} as lists}, warnings). ``reduce``:
    ``reduce(amax, names)`` of the observed {name: (k_amax, v_amax)} before the scales are made (data-parallel
    calibration: the max over ranks, ``ptq.distributed``)."""
    attns = layer_attention(layer, lprefix)
    with observe_kv(attns, per_head=per_head) as obs:
        run_layer(layer, inputs, device, keep_outputs=False)
    amax = obs.amax if reduce is None else reduce(obs.amax, list(attns))
    entries, notes = {}, []
    for name, attn in attns.items():
        if name not in amax:
            notes.append(f"{name}: saw no token while calibrating the KV cache: k_scale = v_scale = 1")
            heads = attn.k_proj.out_features // attn.head_dim if per_head and hasattr(attn, "head_dim") else 1
            k_amax = v_amax = torch.zeros(heads)
        else:
            k_amax, v_amax = amax[name]
        k_scale, v_scale = kv_scale_from_amax(k_amax), kv_scale_from_amax(v_amax)
        set_kv_scales(attn, k_scale, v_scale, format)
        entries[name] = {"k_amax": k_amax.tolist(), "v_amax": v_amax.tolist(),
                         "k_scale": k_scale.tolist(), "v_scale": v_scale.tolist()}
    return entries, notes


__all__ = ["calibrate_kv", "check_kv_layers", "layer_attention"]
