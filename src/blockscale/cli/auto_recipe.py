"""``blockscale quantize MODEL --auto-recipe --effective-bits B [--candidates a,b,c] [--auto-estimator fisher|output]
[--auto-cost total|active] [--kv-cache-bits B [--kv-candidates a,b]]``: a PTQ recipe chosen per unit under a bits budget (``ptq.auto_recipe``), on the
calibration windows the quantize run then uses (--calib / --n-samples / --seq-len / --seed / --calib-bos); the
report table is printed, the recipe written to ``OUT/auto_recipe.yaml`` (``--recipe`` reads it back) and into
``ptq_report.json`` (``ptq.config.auto_recipe``), and PTQ runs with it (--method, --scale-rule: the scale rule /
error / activation scale rule flags set the NVFP4 candidates' options, so the sensitivities measure them).
The flags are checked before the model loads; the model loads whole (the backward pass needs all of it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import UsageError
from .checks import number

AUTO_RECIPE_FILE = "auto_recipe.yaml"
_AUTO_ONLY = (("candidates", "--candidates"), ("auto_estimator", "--auto-estimator"), ("auto_cost", "--auto-cost"),
              ("effective_bits", "--effective-bits"), ("kv_cache_bits", "--kv-cache-bits"),
              ("kv_candidates", "--kv-candidates"))


def add_auto_recipe_flags(q) -> None:
    """The --auto-recipe flags of ``quantize``."""
    g = q.add_argument_group("automatic mixed precision (docs/ptq.md)")
    g.add_argument("--auto-recipe", action="store_true",
                   help="choose each unit's scheme (a Linear, a fused q/k/v or gate/up group, an experts module) "
                        "from calibration sensitivities under --effective-bits; not with --recipe")
    number(g, "--effective-bits", float, lo=0, lo_open=True, hi=64, metavar="B",
           help="with --auto-recipe: the budget, stored bits per weight (scales included) over the quantizable units")
    g.add_argument("--candidates", metavar="A,B,C",
                   help="with --auto-recipe: the schemes to choose from, comma-separated (default: every scheme both "
                        "checkpoint formats store: nvfp4-w4a4,nvfp4-w4a16,fp8-w8a8,mxfp8,bf16)")
    g.add_argument("--auto-estimator", choices=("fisher", "output"),
                   help="with --auto-recipe: gradient-weighted output error (the estimated loss increase; default) "
                        "or the plain output error")
    g.add_argument("--auto-cost", choices=("total", "active"),
                   help="with --auto-recipe: count every parameter (default) or those an average token uses "
                        "(routed experts by their routing frequency)")
    number(g, "--kv-cache-bits", float, lo=0, lo_open=True, hi=64, metavar="B",
           help="with --auto-recipe: also choose the KV cache (bf16 16, fp8-e4m3 8 or nvfp4 4.5 bits per cached "
                "element), the one of least score within B bits per element")
    g.add_argument("--kv-candidates", metavar="A,B",
                   help="with --kv-cache-bits: the KV caches to choose from (default: bf16,fp8-e4m3,nvfp4)")


def auto_recipe_config(args):
    """The ``AutoRecipeConfig`` of the flags (None without --auto-recipe), checked before anything loads:
    --effective-bits required with it, the other flags refused without it, --recipe / --w4a4 / --weights-only
    refused with it; the NVFP4 options flags set on the NVFP4 candidates."""
    from ..ptq.auto_recipe import AutoRecipeConfig
    from ..recipes.ptq_recipe import PTQRecipe, PTQRule, Scheme

    if not args.auto_recipe:
        for dest, flag in _AUTO_ONLY:
            if getattr(args, dest) is not None:
                raise UsageError(f"{flag} needs --auto-recipe")
        return None
    if args.effective_bits is None:
        raise UsageError("--auto-recipe needs --effective-bits B (the budget in stored bits per weight, e.g. 6)")
    if args.recipe is not None:
        raise UsageError("--auto-recipe cannot be combined with --recipe: it writes the recipe (give --recipe "
                         f"OUT/{AUTO_RECIPE_FILE} to reuse one)")
    if args.kv_candidates is not None and args.kv_cache_bits is None:
        raise UsageError("--kv-candidates needs --kv-cache-bits B (the KV cache's budget, bits per cached element)")
    for flag in ("w4a4", "weights_only"):
        if getattr(args, flag):
            raise UsageError(f"--{flag.replace('_', '-')} cannot be combined with --auto-recipe: the candidates set "
                             "each scheme's activations")
    try:
        config = AutoRecipeConfig(effective_bits=args.effective_bits, candidates=args.candidates,
                                  estimator=args.auto_estimator or "fisher", cost=args.auto_cost or "total",
                                  n_samples=args.n_samples, seq_len=args.seq_len, batch_size=args.batch_size,
                                  seed=args.seed, ignore=_ignore(args), kv_cache_bits=args.kv_cache_bits,
                                  kv_candidates=args.kv_candidates)
    except UsageError as e:
        flag = next((f for p, f in (("candidates", "--candidates"), ("kv_candidates", "--kv-candidates"),
                                    ("kv_cache_bits", "--kv-cache-bits")) if str(e).startswith(p)), "--auto-recipe")
        raise UsageError(f"{flag}: {e}") from None
    for key in ("scale_rule", "error", "act_scale_rule"):  # set on the NVFP4 candidates (as with --recipe)
        value = getattr(args, key)
        if value is not None:
            as_rules = PTQRecipe(default=Scheme("bf16"), rules=tuple(PTQRule(f"re:^{i}$", s) for i, s in
                                                                     enumerate(config.candidates)))
            try:
                as_rules = as_rules.with_nvfp4(**{key: value})
            except UsageError as e:
                flag = f"--{key.replace('_', '-')} {value}"
                if "has no NVFP4 scheme that takes" in str(e):
                    raise UsageError(f"{flag}: no candidate takes it (it sets the NVFP4 candidates' option; "
                                     f"candidates: {', '.join(config.labels)})") from None
                raise UsageError(f"{flag}: {e}") from None
            config = dataclasses.replace(config, candidates=tuple(r.scheme for r in as_rules.rules))
    return config


def _ignore(args) -> tuple:
    from ..recipes.recipe import DEFAULT_EXCLUDE

    return tuple(DEFAULT_EXCLUDE) + tuple(p for p in args.exclude or () if p not in DEFAULT_EXCLUDE)


def run_auto_recipe(args, lm, defaults, config):
    """The ``AutoRecipeResult`` on the run's calibration windows (the ones PTQ then uses), its table printed."""
    from ..data.text_sources import calibration_batches
    from ..ptq.auto_recipe import auto_recipe

    if lm.tokenizer is None:
        raise UsageError(f"--auto-recipe measures sensitivities on calibration text, but {args.model} has no "
                         "tokenizer: save one next to the weights")
    calib = args.calib or defaults.calib
    bos = defaults.calib_bos if args.calib is None else args.calib_bos
    ids = calibration_batches(lm.tokenizer, calib, args.n_samples, args.seq_len, seed=args.seed, bos=bos)
    print(f"auto-recipe: measuring {config.estimator} sensitivities of every unit under "
        f"{', '.join(config.labels)} on {calib} ({ids.shape[0]} windows of {ids.shape[1]} tokens) ...", flush=True)
    result = auto_recipe(lm.model, ids, config)
    for line in result.lines():
        print(line)
    return result


def write_auto_recipe(path, result) -> Path:
    """``result``'s recipe as ``path/auto_recipe.yaml``; returns the file."""
    out = Path(path) / AUTO_RECIPE_FILE
    result.save(out)
    return out


__all__ = ["AUTO_RECIPE_FILE", "add_auto_recipe_flags", "auto_recipe_config", "run_auto_recipe", "write_auto_recipe"]
