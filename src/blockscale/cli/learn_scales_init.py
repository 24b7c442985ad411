"""The PTQ initialisation of ``blockscale learn-scales`` for a model-name input: the flags that choose it
(``--scale-rule``, ``--recipe``, ``--w4a4``, ``--act-scale-rule``, ``--rotate``; ``--method`` and its options live
with the command), their checks, and the ``PTQConfig`` they make. A checkpoint input was quantized already, so these
flags are refused there."""
from __future__ import annotations

from ..errors import UsageError
from ..ptq.config import ACT_SCALE_RULES
from .common import check_act_scale_rule, resolve_ptq_recipe, with_nvfp4_flags
from .learn_scales_start import AUTO
from .quantize import given_method_flags, method_options, skip_indivisible
from .rotation_flags import ROTATE_METAVAR


def add_init_arguments(p) -> None:
    """The PTQ-initialisation flags other than --method (added after it, so the help lists them together)."""
    p.add_argument("--scale-rule", default=None, choices=("6", "4over6", "sweep", "hessian", "hessian-4over6"),
                   help="RTN init (model names only; default 6; with --recipe: its NVFP4 schemes' rule)")
    p.add_argument("--recipe", help="RTN init with a PTQ recipe (model names only): a built-in name (blockscale "
                                    "recipes --ptq) or a YAML file; only its NVFP4 modules learn their scales")
    p.add_argument("--w4a4", action="store_true", help="PTQ init with NVFP4 activations (model names only)")
    p.add_argument("--act-scale-rule", default=None, choices=ACT_SCALE_RULES,
                   help="W4A4 activation block-scale rule (with --w4a4 or a W4A4 --recipe; default 6; 4over6: Four "
                        "Over Six on the activations, kept while learning)")
    p.add_argument("--rotate", default=None, metavar=ROTATE_METAVAR,
                   help="rotations before the PTQ init (model names only; as quantize --rotate; fixed while learning). "
                        "A rotated checkpoint input keeps its rotations")


def init_recipe(args, is_ckpt: bool):
    """The PTQ recipe of the initialisation (--recipe, with an explicit --scale-rule / --act-scale-rule applied to
    its NVFP4 schemes); None without --recipe. A checkpoint input was quantized already: the initialisation flags
    are usage errors there; --act-scale-rule needs W4A4 activations to act on."""
    if is_ckpt:
        given = [f for f, v in (("--recipe", args.recipe), ("--scale-rule", args.scale_rule), ("--w4a4", args.w4a4),
                                ("--act-scale-rule", args.act_scale_rule), ("--method", args.method),
                                ("--rotate", args.rotate)) if v]
        given += given_method_flags(args)
        if given:
            raise UsageError(f"{', '.join(given)}: the input {args.model} is a quantized checkpoint already; these "
                             "flags choose the PTQ initialisation of a model name")
        return None
    if args.act_scale_rule == "4over6" and args.learn_input_scales:
        raise UsageError("--learn-input-scales learns the activations' outer scale under the block-scale rule 6; "
                         "drop it or --act-scale-rule 4over6")
    check_act_scale_rule(args)
    if args.recipe is None:
        return None
    if args.w4a4:
        raise UsageError("--w4a4 cannot be combined with --recipe: the recipe sets each scheme's activations")
    recipe = with_nvfp4_flags(resolve_ptq_recipe(args.recipe), args, ("scale_rule", "act_scale_rule"))
    if args.learn_input_scales and any(s.act_scale_rule == "4over6" for s in recipe.schemes()):
        raise UsageError(f"--learn-input-scales learns the activations' outer scale under the block-scale rule 6; "
                         f"--recipe {args.recipe} quantizes activations with act_scale_rule 4over6: drop the flag or "
                         "use a recipe with rule 6")
    return recipe


def ptq_config(args, recipe):
    """The PTQ initialisation of a model-name input (--method / --recipe / --scale-rule / --w4a4 /
    --act-scale-rule / --rotate and the method's options)."""
    from ..ptq import PTQConfig

    flat = {} if recipe is not None else dict(scale_rule=args.scale_rule or "6",
                                              activations="w4a4" if args.w4a4 else "w4a16",
                                              act_scale_rule=args.act_scale_rule or "6")
    method = args.method if args.method not in (None, AUTO) else "rtn"  # (auto: each candidate sets its own)
    return PTQConfig(method=method, recipe=recipe, **flat, options=method_options(args, method),
                     skip_indivisible=skip_indivisible(args.skip_indivisible, args.model),
                     n_samples=args.n_samples, seq_len=args.seq_len, rotate=args.rotate or "none")


__all__ = ["add_init_arguments", "init_recipe", "ptq_config"]
