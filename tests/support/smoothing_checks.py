"""Checks of AWQ / SmoothQuant on MoE decoder layers (tests/ptq/test_smoothing_moe.py,
test_smoothing_gpt_oss.py): logits and routing decisions before and after folding, random scales folded into
every smoothing group, a PTQ config that quantizes one MoE layer on the full-precision model's inputs, a spy
on a method's folded parameters, the per-column scale between two weights."""
from __future__ import annotations

import torch

from blockscale.ptq import PTQConfig
from blockscale.ptq.smoothing import MoESmoothingGroup, fold_moe_smoothing, fold_smoothing, layer_smoothing_groups
from blockscale.recipes.recipe import DEFAULT_EXCLUDE


def logits_and_routing(model, ids):
    """Logits, and each router's chosen experts per token (sorted: the routing decision)."""
    picks, handles = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):  # the router: ``gate`` (gpt-oss: ``router``)
            router = getattr(layer.mlp, "router", None) or layer.mlp.gate
            handles.append(router.register_forward_hook(
                lambda m, a, out: picks.append(out[-1].sort(-1).values.clone())))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits, picks


def fold_random_scales(model, seed=0, drop_router=False, notes=()):
    """Random positive scales folded into every smoothing group of every layer (``notes``: what each layer
    must report as unsmoothed); ``drop_router``: the router left out of the norm group."""
    g = torch.Generator().manual_seed(seed)
    expected = list(notes)
    for layer in model.model.layers:
        groups, notes = layer_smoothing_groups(layer)
        assert notes == expected
        for grp in groups:
            s = torch.exp(0.5 * torch.randn(grp.in_features, generator=g, dtype=torch.float64))
            if isinstance(grp, MoESmoothingGroup):
                if drop_router and grp.name == "mlp.gate_up":
                    grp = MoESmoothingGroup(grp.name, grp.prev, [c for c in grp.consumers
                                                                 if c.name not in ("mlp.gate", "mlp.router")],
                                            grp.prev_name)
                fold_moe_smoothing(grp, s)
            else:
                fold_smoothing(grp, s)


def mlps_from_layer_config(method, L, **kw):
    """PTQ of the MLPs of layers L and after only: attention and earlier layers stay in high precision, so
    layer L sees the full-precision model's inputs in every run."""
    exclude = (*DEFAULT_EXCLUDE, r"self_attn", *([rf"layers\.{i}\." for i in range(L)]))
    return PTQConfig(method=method, exclude=exclude, allow_partial=True, **kw)


class Snapshot:
    """Wraps ``cls.transform_layer`` to keep a copy of layer L's parameters right after folding."""

    def __init__(self, monkeypatch, cls, L):
        self.params = None
        orig = cls.transform_layer

        def spy(method, ctx):
            out = orig(method, ctx)
            if ctx.index == L:
                self.params = {n: p.detach().float().clone() for n, p in ctx.module.named_parameters()}
            return out

        monkeypatch.setattr(cls, "transform_layer", spy)


def column_scale(folded, orig):
    """s with folded[:, j] = orig[:, j] * s[j]."""
    return folded.abs().sum(0) / orig.abs().sum(0)
