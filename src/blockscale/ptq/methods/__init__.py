"""The PTQ methods, by name: each is one module (or folder) implementing ``ptq.protocol.PTQMethod``
with its own options dataclass. A new method: one more module here and one ``register_method`` line."""
from __future__ import annotations

from ...errors import UsageError
from ..protocol import PTQMethod
from .autoround import AutoRound, AutoRoundOptions
from .awq import AWQ, AWQOptions
from .gptq import GPTQ, GPTQOptions
from .rtn import RTN, RTNOptions
from .smoothquant import SmoothQuant, SmoothQuantOptions

METHODS: dict[str, type[PTQMethod]] = {}


def register_method(cls: type[PTQMethod]) -> type[PTQMethod]:
    """Make ``cls`` available as ``PTQConfig(method=cls.name)`` and ``blockscale quantize --method``
    (its options become ``--<flag_prefix>-<field>`` flags). Usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, PTQMethod)) or not cls.name:
        raise TypeError(f"register_method: expected a named PTQMethod subclass, got {cls!r}")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"register_method: a method named {cls.name!r} is registered already")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> type[PTQMethod]:
    """The method class registered as ``name``; UsageError naming the registered ones otherwise."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise UsageError(f"method={name!r} is not supported; allowed values: "
                         + ", ".join(map(repr, METHODS))) from None


register_method(RTN)
register_method(AWQ)
register_method(SmoothQuant)
register_method(GPTQ)
register_method(AutoRound)

__all__ = ["AWQ", "AWQOptions", "AutoRound", "AutoRoundOptions", "GPTQ", "GPTQOptions", "METHODS", "RTN", "RTNOptions", "SmoothQuant",
           "SmoothQuantOptions", "get_method", "register_method"]
