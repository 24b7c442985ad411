"""Method options: frozen dataclasses whose fields declare their own help, bounds and command-line flag.

Each PTQ method has one options dataclass (``AWQOptions``, ``GPTQOptions``, ...). Its fields are made with
``option(default, help, ...)``, which records in the field's metadata what the value may be (a bool, an
int or a float within [lo, hi], or one of ``choices``: the kind is the default's type). The same
metadata validates the dataclass (``check_options``, called from its ``__post_init__``) and builds the
``blockscale quantize`` flags (``cli.quantize.add_method_flags``), so a bound is written once.
"""
from __future__ import annotations

import math
from dataclasses import field, fields
from typing import Optional

from ..errors import UsageError


class OptionError(UsageError):
    """A method option out of its range; ``field`` names it, ``reason`` says what is allowed."""

    def __init__(self, owner: str, name: str, value, reason: str):
        super().__init__(f"{owner}.{name}={value!r}: {reason}")
        self.field, self.value, self.reason = name, value, reason


def option(default, help: str, *, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
           choices: Optional[tuple] = None, flag: Optional[str] = None):
    """A dataclass field of a method's options: ``default`` (its type is the option's kind; ``None``: a
    boolean that may also be left unset, "auto", for the method to decide), ``help`` (one line for
    ``--help``), bounds ``lo`` / ``hi`` (``*_open``: strict) for numbers, ``choices`` for strings, and
    ``flag``: the flag's name after the method's prefix (default: the field name with ``-`` for ``_``;
    e.g. ``four_over_six`` -> ``"4over6"`` gives ``--gptq-4over6``)."""
    meta = dict(help=help, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, choices=choices, flag=flag)
    return field(default=default, metadata=meta)


def option_kind(f) -> type:
    """The kind of an options field: the default's type; ``bool`` for an "auto" boolean (default None)."""
    return bool if f.default is None else type(f.default)


def _range(m: dict) -> str:
    lo, hi = m["lo"], m["hi"]
    if lo is not None and hi is not None:
        return f"in {'(' if m['lo_open'] else '['}{lo:g}, {hi:g}{')' if m['hi_open'] else ']'}"
    if lo is not None:
        return f"{'>' if m['lo_open'] else '>='} {lo:g}"
    return f"{'<' if m['hi_open'] else '<='} {hi:g}"


def check_value(owner: str, f, value) -> None:
    """OptionError unless ``value`` fits field ``f`` of an options dataclass named ``owner``."""
    m, kind = f.metadata, option_kind(f)
    if kind is bool:
        if f.default is None and value is None:
            return
        if not isinstance(value, bool):
            raise OptionError(owner, f.name, value, "expected True or False"
                              + (" or None (auto)" if f.default is None else ""))
        return
    if kind is str:
        if m["choices"] is not None and value not in m["choices"]:
            raise OptionError(owner, f.name, value, "allowed values: " + ", ".join(map(repr, m["choices"])))
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise OptionError(owner, f.name, value, "expected an int" if kind is int else "expected a number")
    lo, hi = m["lo"], m["hi"]
    bad = not math.isfinite(value)
    bad = bad or (lo is not None and (value <= lo if m["lo_open"] else value < lo))
    bad = bad or (hi is not None and (value >= hi if m["hi_open"] else value > hi))
    if bad:
        rng = f" {_range(m)}" if lo is not None or hi is not None else ""
        raise OptionError(owner, f.name, value, f"must be a finite {'int' if kind is int else 'number'}{rng}")


def check_options(options) -> None:
    """Check every field of an options dataclass against its ``option`` metadata."""
    for f in fields(options):
        if "help" in f.metadata:
            check_value(type(options).__name__, f, getattr(options, f.name))


def option_fields(options_type) -> list:
    """The fields of an options dataclass made with ``option`` (what the CLI turns into flags)."""
    return [f for f in fields(options_type) if "help" in f.metadata]


def flag_suffix(f) -> str:
    """The part of a field's flag after the method's prefix: ``block_size`` -> ``block-size``."""
    return f.metadata["flag"] or f.name.replace("_", "-")


__all__ = ["OptionError", "check_options", "check_value", "flag_suffix", "option", "option_fields", "option_kind"]
