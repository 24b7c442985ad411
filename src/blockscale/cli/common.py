"""Pieces every ``blockscale`` subcommand shares: recipe / dtype flags, thread setup, progress bars on a
terminal only, JSON-safe records, the --debug / --threads / --skip-indivisible flags."""
from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .checks import MAX_THREADS, check_int, number
from .reporting import warn

DEBUG_HELP = "show the full traceback of an error (default: one line)"


def checkpoint_formats() -> tuple[str, ...]:
    """The registered checkpoint formats (``--format`` choices), compressed-tensors first."""
    from ..export import FORMATS

    return tuple(FORMATS)


def resolve_recipe(value: str, flag: str = "--recipe"):
    """The Recipe a flag names (a built-in name or a YAML file); a bad one is a UsageError naming the flag."""
    from ..recipes import get_recipe

    try:
        return get_recipe(value)
    except (ValueError, TypeError, OSError) as exc:
        named = str(value) in str(exc)  # the message names the file already
        prefix = (f"{flag}: " if flag.startswith("-") else "") if named else f"{flag} {value}: "
        raise UsageError(f"{prefix}{exc}") from None


def resolve_ptq_recipe(value: str, flag: str = "--recipe"):
    """The PTQRecipe a flag names (a built-in PTQ recipe or a YAML file, which must be a regular file);
    a bad one is a UsageError naming the flag (one line)."""
    from pathlib import Path

    from ..recipes import get_ptq_recipe, list_ptq_recipes, list_recipes

    if str(value) not in list_ptq_recipes() and not Path(value).expanduser().exists():
        names = ", ".join(list_ptq_recipes())
        if str(value) in list_recipes():
            raise UsageError(f"{flag} {value}: a training recipe (blockscale train --recipe), not a PTQ recipe; PTQ "
                             f"recipes: {names}, or a YAML file")
        raise UsageError(f"{flag} {value}: neither a built-in PTQ recipe ({names}) nor an existing YAML file")
    try:
        return get_ptq_recipe(value)
    except (ValueError, TypeError, OSError) as exc:
        prefix = f"{flag}: " if flag.startswith("-") else ""  # the message names the file already
        raise UsageError(f"{prefix}{' '.join(str(exc).split())}") from None


def with_nvfp4_flags(recipe, args, keys):
    """``recipe`` with each of ``keys`` (scale_rule, error, act_scale_rule) given on the command line set on its NVFP4
    schemes; a recipe without such a scheme is a UsageError naming the flag."""
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            try:
                recipe = recipe.with_nvfp4(**{key: value})
            except UsageError as exc:
                raise UsageError(f"--{key.replace('_', '-')} {value}: {exc}") from None
    return recipe


def check_act_scale_rule(args) -> None:
    """--act-scale-rule acts on W4A4 activations: refused without --w4a4, a --recipe or --auto-recipe (nothing to
    act on, and dropping it silently would hide the mistake)."""
    if args.act_scale_rule is not None and not (args.w4a4 or args.recipe or getattr(args, "auto_recipe", None)):
        raise UsageError(f"--act-scale-rule {args.act_scale_rule}: sets the rule of the W4A4 activations' block "
                         "scales; add --w4a4 (or a W4A4 --recipe)")


def is_ptq_recipe_file(path) -> bool:
    """Whether ``path`` is a YAML file holding a PTQ recipe (PTQ-only keys such as ``default`` / ``rules``
    and none of a training recipe's); False for anything unreadable (the training loader then reports it)."""
    from pathlib import Path

    import yaml

    from ..recipes.ptq_serialize import MAX_RECIPE_BYTES, RECIPE_KEYS

    p = Path(path).expanduser()
    try:
        if not p.is_file() or p.stat().st_size > MAX_RECIPE_BYTES:
            return False
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError):
        return False
    if not isinstance(data, dict):
        return False
    keys = set(map(str, data))
    return bool(keys & (set(RECIPE_KEYS) - {"name", "description"})) and not keys & {"linear", "exclude",
                                                                                      "last_blocks_fraction",
                                                                                      "last_blocks_recipe"}


def parse_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise UsageError(f"--dtype {name!r}; allowed values: {', '.join(table)}")
    return table[name]


def setup(args) -> None:
    import torch

    threads = getattr(args, "threads", None)
    if threads is not None:
        torch.set_num_threads(check_int(threads, "--threads", 1, MAX_THREADS))
    show_progress()


def show_progress() -> bool:
    """Progress bars only on a terminal: when stderr is a file or pipe (logs, CI) they are turned off,
    transformers' loading bars too, so stderr holds only warnings and the error line."""
    if sys.stderr.isatty():
        return True
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return False
    hf_logging.disable_progress_bar()
    return False


def local_path(model: str):
    """``model`` as a Path when it names something on this machine (the model being read), else None."""
    from pathlib import Path

    p = Path(model).expanduser()
    return p if p.exists() else None


def check_eval_ctx(prog: str, model, ctx: int, given: bool) -> None:
    """One warning line when ``ctx`` exceeds the model's ``max_position_embeddings``."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and ctx > limit:
        what = f"--ctx {ctx}" if given else f"the default context {ctx} (set --ctx)"
        warn(prog, f"{what} exceeds the model's max_position_embeddings {limit}: positions beyond it were not "
                   "trained, so the perplexity may not mean much")


def add_skip_indivisible(p) -> None:
    """--skip-indivisible / --no-skip-indivisible (not given: on for built-in models, off otherwise)."""
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-indivisible", action="store_true", default=None,
                      help="keep Linears whose in_features is not a multiple of 16 in high precision instead of "
                           "failing (default: on for the built-in models, off otherwise)")
    skip.add_argument("--no-skip-indivisible", dest="skip_indivisible", action="store_false",
                      help="fail on such Linears, even for a built-in model")


def add_common(p, threads: bool = True) -> None:
    """--debug on every subcommand (also accepted before it), --threads where torch computes."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    if threads:
        number(p, "--threads", int, lo=1, hi=MAX_THREADS, help="torch CPU threads")


__all__ = ["DEBUG_HELP", "add_common", "check_act_scale_rule", "add_skip_indivisible", "check_eval_ctx", "checkpoint_formats",
           "is_ptq_recipe_file", "local_path", "parse_dtype", "resolve_ptq_recipe", "resolve_recipe", "setup",
           "show_progress", "with_nvfp4_flags"]
