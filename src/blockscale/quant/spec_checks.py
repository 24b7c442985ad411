"""Argument checks shared by the format specs' ``__post_init__`` (ValueError naming the allowed values)."""
from __future__ import annotations

from ..formats.minifloat import ROUNDING_MODES, SR_MODES


def check_choice(name: str, value, allowed) -> None:
    """ValueError unless ``value`` is one of ``allowed`` (the message names the argument and them)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def check_rounding(rounding: str, sr_mode: str) -> None:
    """Element rounding ("nearest" | "stochastic") and stochastic-rounding mode ("hardware" | "exact")."""
    check_choice("rounding", rounding, ROUNDING_MODES)
    check_choice("sr_mode", sr_mode, SR_MODES)


__all__ = ["check_choice", "check_rounding"]
