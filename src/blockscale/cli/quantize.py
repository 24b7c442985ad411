"""The ``quantize`` command's PTQ specifics.

Method flags: every registered PTQ method's options dataclass becomes flags ``--<flag_prefix>-<field>``
(``--awq-grid``, ``--sq-alpha``, ``--gptq-damp``, ``--gptq-4over6``, ...), read from the fields' metadata
(kind, default, bounds, choices, help): ``add_method_flags`` / ``method_options``. A new method's options
appear here without editing the command line.

Built-in models whose Linears cannot all be packed: stories260K's ``down_proj`` has ``in_features=172``,
not a multiple of the NVFP4 block (16). For built-in models ``--skip-indivisible`` is on by default
(those Linears stay in high precision, listed in the report); ``--no-skip-indivisible`` makes them an
error again. Either way the skipped Linears are reported in ONE warning line, not one per PTQ warning.
"""
from __future__ import annotations

import argparse
import re
import warnings
from typing import Callable, Optional

from .checks import number
from .reporting import warn
from ..errors import UsageError
from ..ptq.methods import METHODS, get_method
from ..ptq.options import OptionError, flag_suffix, option_fields, option_kind

INDIVISIBLE_NOTE = "is not a multiple of 16: kept in high precision"
_INDIVISIBLE = re.compile(r"is not a multiple of (\d+): kept in high precision")  # 16 NVFP4, 32 MX schemes
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def method_names() -> tuple[str, ...]:
    """The ``--method`` choices: the registered PTQ methods."""
    return tuple(METHODS)


def _flag(cls, f) -> str:
    return f"--{cls.flag_prefix}-{flag_suffix(f)}"


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_method_flags(parser) -> None:
    """One flag per option of every registered method, in a "--method NAME options" group: numbers with
    their bounds (checked by ``check_numbers``), strings with their choices, booleans as ``--flag`` (default
    off) or ``--flag`` / ``--no-flag`` (default on); defaults and help from the options dataclass."""
    for cls in METHODS.values():
        fields = option_fields(cls.Options)
        if not fields:
            continue
        group = parser.add_argument_group(f"--method {cls.name} options")
        for f in fields:
            m, kind, flag = f.metadata, option_kind(f), _flag(cls, f)
            if kind is bool:  # default off: --flag; on or None (the method decides): --flag / --no-flag
                action = "store_true" if f.default is False else argparse.BooleanOptionalAction
                group.add_argument(flag, action=action, default=f.default, help=m["help"])
            elif kind is str:
                group.add_argument(flag, default=f.default, choices=m["choices"], help=m["help"])
            else:
                number(group, flag, kind, lo=m["lo"], hi=m["hi"], lo_open=m["lo_open"], hi_open=m["hi_open"],
                       default=f.default, help=m["help"])


def method_options(args, method: str):
    """The options dataclass of ``method`` from its flags (those of other methods are not read); a value
    its dataclass refuses is a UsageError naming the flag."""
    cls = get_method(method)
    values = {}
    flags = {}
    for f in option_fields(cls.Options):
        flags[f.name] = _flag(cls, f)
        values[f.name] = getattr(args, _dest(flags[f.name]), f.default)
    try:
        return cls.Options(**values)
    except OptionError as err:
        raise UsageError(f"{flags[err.field]} {err.value}: {err.reason}") from None


def given_method_flags(args) -> list[str]:
    """The method-option flags (of any method) given a value other than their default."""
    return [_flag(cls, f) for cls in METHODS.values() for f in option_fields(cls.Options)
            if getattr(args, _dest(_flag(cls, f)), f.default) != f.default]


def is_builtin(model: str) -> bool:
    """Whether ``model`` names a built-in model (``stories260k``, ``smollm2-135m``, ``smollm2``)."""
    from ..models.hf import BUILTIN_MODELS

    return str(model).lower() in BUILTIN_MODELS or str(model).lower() == "smollm2"


def skip_indivisible(flag: Optional[bool], model: str) -> bool:
    """The value of ``--skip-indivisible`` / ``--no-skip-indivisible``; not given: on for built-in models."""
    return is_builtin(model) if flag is None else bool(flag)


def no_tokenizer_error(args, cfg, recipe) -> UsageError:
    """The error for a calibrating configuration on a model without a tokenizer, naming what calibrates
    (the method, the recipe's or --w4a4's static scales) and only the ways out that apply."""
    why, ways = [], []
    if METHODS[cfg.method].calibrates:
        why.append(f"--method {cfg.method}")
        ways.append("--method rtn")
    if cfg.ptq_recipe.needs_calibration:
        if recipe is not None:
            why.append(f"the static activation / KV-cache scales of --recipe {recipe.name}")
            ways.append("a recipe without static scales")
        else:
            why.append("the static activation scales of --w4a4")
            ways.append("W4A16 (no --w4a4)")
    return UsageError(f"{' and '.join(why)} {'calibrate' if len(why) > 1 else 'calibrates'} on text, but "
                      f"{args.model} has no tokenizer: save one next to the weights, or use {' with '.join(ways)}")


def group_names(names) -> str:
    """Module names with their layer index folded: ``model.layers.*.mlp.down_proj (5)``."""
    counts: dict[str, int] = {}
    for n in names:
        key = _LAYER_INDEX.sub(".*.", n, count=1)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k + (f" ({c})" if c > 1 else "") for k, c in counts.items())


def quantize_reported(prog: str, run: Callable, *, defaulted: bool):
    """``run()`` (a PTQ call returning a ``PTQReport``) with the warnings about Linears kept in high
    precision because ``in_features`` is not whole blocks of their scheme (16 NVFP4, 32 MX) folded into one ``<prog>: warning:`` line; every other
    warning is passed on (``defaulted``: the skip came from the built-in default, which the line says)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run()
    skipped = [w.split(":", 1)[0] for w in report.warnings if _INDIVISIBLE.search(w)]
    blocks = sorted({int(m.group(1)) for m in map(_INDIVISIBLE.search, report.warnings) if m})
    folded = set(skipped)
    for w in caught:
        msg = str(w.message)
        only_skips = (msg.startswith(f"{len(skipped)} layer(s) need attention") or
                      ("of the decoder layers' weight elements" in msg and
                       set(report.high_precision_elements) <= folded))
        if skipped and only_skips:
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if skipped:
        share = 100 * report.high_precision_fraction
        how = ("skipped by default for built-in models; --no-skip-indivisible makes it an error" if defaulted
               else "--skip-indivisible")
        warn(prog, f"kept {len(skipped)} Linear(s) in high precision because in_features is not a multiple of "
                   f"{' / '.join(map(str, blocks))}: "
                   f"{group_names(skipped)} ({share:.1f}% of the decoder weight elements; {how}; listed in the "
                   "report)")
    return report


__all__ = ["INDIVISIBLE_NOTE", "add_method_flags", "given_method_flags", "group_names", "is_builtin", "method_names",
           "method_options", "quantize_reported", "skip_indivisible"]
