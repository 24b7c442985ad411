"""Before any work: can the checkpoint format store every scheme of the recipe?

``check_recipe_exportable(recipe, format)`` builds each scheme's inference module once on a small
weight (128 x 128: whole blocks of every format), reads its ``export.module_schemes.scheme_of`` and asks
the format, as ``export_checkpoint`` will after calibration (``MixedFormat.check``). So a recipe with an
``fp8-block`` scheme and ``format="modelopt"`` (ModelOpt has no quant_algo for it) or per-head KV scales
in ModelOpt is refused in a second, not after calibrating the whole model.
"""
from __future__ import annotations

import torch

from ..errors import UsageError
from ..export import format_named
from ..export.module_schemes import scheme_of
from .scheme_modules import build_linear
from .scheme_quantize import group_weight_scale, rtn_quantize


def _module_scheme(scheme):
    w = torch.linspace(-1.0, 1.0, 128 * 128, dtype=torch.float32).reshape(128, 128)
    q = rtn_quantize(w, scheme.weight_spec, group_weight_scale(scheme, [w]))
    return scheme_of(build_linear(q, None, scheme, 1.0, torch.float32))


def check_recipe_exportable(recipe, format: str) -> None:
    """UsageError naming the format and the scheme when ``format`` cannot store a scheme of ``recipe``
    (a PTQ recipe) or its KV-cache scales; ``format``: a registered checkpoint format name."""
    fmt = format_named(format)
    where = {"the default": recipe.default, **{f"rule {i} ({r.match!r})": r.scheme for i, r in enumerate(recipe.rules)}}
    schemes = {w: _module_scheme(s) for w, s in where.items() if not s.is_high_precision}
    if not schemes:
        return
    kv = None if recipe.kv_cache is None else ("head" if recipe.kv_cache.per_head else "tensor")
    all_nvfp4 = all(s.is_nvfp4 for s in schemes.values()) and len({s.inputs for s in schemes.values()}) == 1
    if fmt.mixed is None and not (all_nvfp4 and kv is None):
        raise UsageError(f"format={fmt.name!r} stores all-NVFP4 checkpoints only; recipe {recipe.name!r} needs "
                         "several schemes or a KV cache: use format='compressed-tensors'")
    if fmt.mixed is None:
        return
    try:
        fmt.mixed.check(schemes, kv)
    except ValueError as e:
        raise UsageError(f"format={fmt.name!r} (--format) cannot store recipe {recipe.name!r}: {e}") from None


__all__ = ["check_recipe_exportable"]
