"""Before any work: can the checkpoint format store every scheme of the recipe?

``check_recipe_exportable(recipe, format)`` asks the format, for the stored form of each scheme
(``Scheme.stored``: what ``export.module_schemes.scheme_of`` reads from the inference module PTQ builds),
as ``export_checkpoint`` will after calibration (``export.check_stores``: a codec for every scheme, KV-cache
naming, the format's own rules). So a recipe with an ``fp8-block`` scheme and ``format="modelopt"``
(ModelOpt has no quant_algo for it) or per-head KV scales in ModelOpt is refused in a second, not after
calibrating the whole model.
"""
from __future__ import annotations

from ..errors import UsageError
from ..export import check_stores, format_named
from ..export.module_schemes import ModuleScheme


def check_recipe_exportable(recipe, format: str) -> None:
    """UsageError naming the format and the scheme when ``format`` cannot store a scheme of ``recipe``
    (a PTQ recipe) or its KV-cache scales; ``format``: a registered checkpoint format name."""
    fmt = format_named(format)
    where = {"the default": recipe.default, **{f"rule {i} ({r.match!r})": r.scheme for i, r in enumerate(recipe.rules)}}
    schemes = {w: ModuleScheme(*s.stored) for w, s in where.items() if not s.is_high_precision}
    if not schemes:
        return
    kv = None if recipe.kv_cache is None else "nvfp4" if recipe.kv_cache.format == "nvfp4" else \
        "head" if recipe.kv_cache.per_head else "tensor"
    try:
        check_stores(fmt, schemes, kv)
    except ValueError as e:
        raise UsageError(f"format={fmt.name!r} (--format) cannot store recipe {recipe.name!r}: {e}") from None


__all__ = ["check_recipe_exportable"]
