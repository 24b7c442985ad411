"""PTQ recipes as data: which quantization scheme each Linear of a model gets after training.

A ``PTQRecipe`` is an ordered list of rules ``{match, scheme}`` (the first rule whose ``match`` fits a
Linear's full module name wins), a ``default`` scheme for the Linears no rule matches, an ``ignore``
list (regexes, ``re.search`` on the name: kept in bf16 / fp32, like ``PTQConfig.exclude``) and an
optional FP8 KV cache. A ``Scheme`` names the formats of one Linear's weight and input:

    nvfp4-w4a4    NVFP4 weights, NVFP4 activations (dynamic per-16 block scales, one calibrated outer scale)
    nvfp4-w4a16   NVFP4 weights, activations in the model dtype
    fp8-w8a8      E4M3 weights (one scale per tensor or per output channel), E4M3 activations (static:
                  one calibrated scale per tensor, s = amax / 448; dynamic: one per token)
    fp8-block     E4M3 weights in 128x128 tiles, dynamic 1x128 E4M3 activations (DeepSeek-V3)
    mxfp8         MXFP8 (E4M3 + UE8M0 per 32) weights and dynamic activations
    mxfp4         MXFP4 (E2M1 + UE8M0 per 32) weights and dynamic activations
    mxfp4-w4a16   MXFP4 weights, activations in the model dtype
    bf16          kept in high precision (the model dtype)

Serialized by ``ptq_serialize`` (YAML); the built-ins are in ``ptq_builtin``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Optional

from ..errors import UsageError
from ..quant import NVFP4
from ..quant.schemes import RECIPE_SCHEME_NAMES, scheme_row
from .recipe import DEFAULT_EXCLUDE

SCHEME_NAMES = RECIPE_SCHEME_NAMES  # the rows of quant.schemes.SCHEME_TABLE a recipe may name
MODULE_CLASSES = ("attention", "mlp", "experts", "shared_experts", "router")
KV_CACHE_FORMATS = ("fp8-e4m3", "nvfp4")

# scheme -> {option: allowed values, the first being the default}: the table's rows
SCHEME_OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {n: dict(scheme_row(n).options) for n in SCHEME_NAMES}
OPTION_NAMES = ("scale_rule", "error", "act_scale_rule", "weights", "activations")


def _takers(option: str) -> str:
    return ", ".join(n for n in SCHEME_NAMES if option in SCHEME_OPTIONS[n])


@dataclass(frozen=True)
class Scheme:
    """The quantization of one Linear (see the module docstring for the names).

    scale_rule: nvfp4-*: "6" (default), "4over6" or "sweep" (weight block scales), or the Hessian-aware
      "hessian" / "hessian-4over6" (the sweep's / 4/6's candidates, error weighted by the calibration
      inputs' per-channel second moments; need calibration; ``weight_spec`` is the base "sweep" / "4over6"
      spec, see ``quant.nvfp4.weighted``); mx*: "ceil" (default) or "floor" (UE8M0 scale rounding).
    error: nvfp4-*: the 4/6 block error "mse" (default), "mae" or "maxabs".
    act_scale_rule: nvfp4-w4a4: "6" (default) or "4over6" for the activations.
    weights: fp8-w8a8: "tensor" (default; one scale) or "channel" (one per output row).
    activations: fp8-w8a8: "static" (default; one calibrated scale per tensor) or "dynamic" (per token).
    An option left None takes the scheme's default (stored resolved); an option a scheme does not take
    stays None and giving it is a UsageError.
    """

    name: str
    scale_rule: Optional[str] = None
    error: Optional[str] = None
    act_scale_rule: Optional[str] = None
    weights: Optional[str] = None
    activations: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or self.name not in SCHEME_NAMES:
            raise UsageError(f"scheme {self.name!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, SCHEME_NAMES))}")
        allowed = SCHEME_OPTIONS[self.name]
        for option in OPTION_NAMES:
            value = getattr(self, option)
            if option not in allowed:
                if value is not None:
                    raise UsageError(f"scheme {self.name!r} does not take {option}={value!r}; {option} applies to "
                                     f"{_takers(option)}")
                continue
            if value is None:
                object.__setattr__(self, option, allowed[option][0])
            elif value not in allowed[option]:
                raise UsageError(f"scheme {self.name!r}: {option}={value!r} is not supported; allowed values: "
                                 f"{', '.join(map(repr, allowed[option]))}")

    @property
    def options(self) -> dict[str, str]:
        """The options this scheme takes, with their values."""
        return {k: getattr(self, k) for k in SCHEME_OPTIONS[self.name]}

    @property
    def row(self):
        """Its row of ``quant.schemes.SCHEME_TABLE``."""
        return scheme_row(self.name)

    @property
    def family(self) -> str:
        """The format family of its weights: "nvfp4", "fp8", "mx" or "none" (bf16)."""
        return self.row.family

    @property
    def is_high_precision(self) -> bool:
        """Whether Linears of this scheme stay unquantized (bf16)."""
        return self.row.weight(self.options) is None

    @property
    def stored(self):
        """The (kind, weights, inputs) its Linears are stored as (``export.module_schemes.ModuleScheme``'s
        fields; e.g. fp8-w8a8 dynamic -> ("fp8", "tensor", "token")); None for bf16."""
        return self.row.stored(self.options)

    @property
    def noun(self) -> str:
        """How messages name the format whose blocks it needs ("NVFP4", "mxfp4 (MX)", ...)."""
        return self.row.noun

    def input_quantizer(self, amax: float):
        """x -> the inputs its inference Linear feeds the GEMM (static scale from the calibrated input
        ``amax`` where it has one); None for weights-only schemes."""
        return self.row.input_quantizer(self.options, amax)

    @property
    def quantizes_activations(self) -> bool:
        """Whether the Linear's input is quantized (statically or dynamically)."""
        return self.row.inputs(self.options) is not None

    @property
    def static_activations(self) -> bool:
        """Whether the input scale is calibrated (nvfp4-w4a4's outer scale, fp8-w8a8 static)."""
        return self.row.inputs(self.options) == "static"

    @property
    def hessian_scales(self) -> bool:
        """Whether the weight block scales are chosen with calibration channel weights (NVFP4 scale_rule
        "hessian" / "hessian-4over6")."""
        return self.scale_rule in self.row.weighted_rules

    @property
    def block_size(self) -> Optional[int]:
        """The block along in_features the weight needs whole (16 NVFP4, 32 MX); None: any in_features
        (FP8 per tensor / channel, fp8-block pads its 128x128 tiles, bf16)."""
        return self.row.block_size

    @property
    def weight_spec(self):
        """The weight's format spec: NVFP4 / FP8 / MX, or None for bf16 (a Hessian-aware rule: the base
        "sweep" / "4over6" spec, its stored format)."""
        return self.row.weight(self.options)

    @property
    def label(self) -> str:
        """Short text for tables: the name and its non-default options, e.g. "nvfp4-w4a4 4over6-mae a:4over6",
        "fp8-w8a8 channel/dynamic", "mxfp4 floor", "bf16"."""
        return " ".join([self.name] + self.row.label(self.options))

    def replace(self, **changes) -> "Scheme":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """{"name": ..., <the options this scheme takes>} (the YAML form)."""
        return {"name": self.name, **self.options}

    @classmethod
    def from_value(cls, value, where: str = "scheme") -> "Scheme":
        """A Scheme from a Scheme, a name ("fp8-w8a8") or a mapping ({name: ..., <options>}); a bad one
        is a UsageError naming ``where``, the key and the allowed keys / values."""
        if isinstance(value, Scheme):
            return value
        if isinstance(value, str):
            return _scheme(where, name=value)
        if not isinstance(value, dict):
            raise UsageError(f"{where}: expected a scheme name ({', '.join(SCHEME_NAMES)}) or a mapping "
                             f"{{name: ..., <options>}}, got {value!r}")
        if "name" not in value:
            raise UsageError(f"{where}: missing 'name' (one of {', '.join(SCHEME_NAMES)})")
        d = {str(k): v for k, v in value.items()}
        name = d["name"]
        if isinstance(name, str) and name in SCHEME_NAMES:
            allowed = ["name", *SCHEME_OPTIONS[name]]
            unknown = sorted(k for k in d if k not in allowed and k not in OPTION_NAMES)
            if unknown:
                raise UsageError(f"{where}: unknown key(s) {unknown} for scheme {name!r}; allowed: {allowed}")
        else:
            unknown = sorted(k for k in d if k != "name" and k not in OPTION_NAMES)
            if unknown:
                raise UsageError(f"{where}: unknown key(s) {unknown}; allowed: {['name', *OPTION_NAMES]}")
        for k, v in d.items():
            if k != "name" and isinstance(v, int) and not isinstance(v, bool):
                d[k] = str(v)  # YAML reads `scale_rule: 6` as the int 6
            elif k != "name" and v is not None and not isinstance(v, str):
                raise UsageError(f"{where}: {k}={v!r}; expected a string")
        return _scheme(where, **d)


def _scheme(where: str, **kwargs) -> Scheme:
    try:
        return Scheme(**kwargs)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None


def check_regexes(patterns, what: str) -> tuple[str, ...]:
    """``patterns`` as a tuple of valid regular expressions (UsageError naming ``what`` and the bad one)."""
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise UsageError(f"{what}={patterns!r}: expected a list of regular expressions (strings)")
    for pat in patterns:
        if not isinstance(pat, str):
            raise UsageError(f"{what}: {pat!r} is not a string (a regular expression)")
        try:
            re.compile(pat)
        except re.error as exc:
            raise UsageError(f"{what}: {pat!r} is not a valid regular expression: {exc}") from None
    return tuple(patterns)


@dataclass(frozen=True)
class PTQRule:
    """One rule of a PTQ recipe: the Linears ``match`` selects get ``scheme``.

    match: a module class ("attention", "mlp", "experts", "shared_experts", "router": see
      ``ptq.scheme_plan.module_classes``), "re:<regex>" (``re.search`` on the full module name) or
      otherwise an ``fnmatch`` glob on the full name (``"*.self_attn.*"``, ``"model.layers.0.*"``).
    scheme: a Scheme (a name or a mapping is converted).
    """

    match: str
    scheme: Scheme

    def __post_init__(self):
        if not isinstance(self.match, str) or not self.match.strip():
            raise UsageError(f"rule match={self.match!r}: expected a module class ({', '.join(MODULE_CLASSES)}), "
                             "'re:<regex>' or a glob on the module name")
        if self.match.startswith("re:"):
            check_regexes([self.match[3:]], f"rule match {self.match!r}")
        object.__setattr__(self, "scheme", Scheme.from_value(self.scheme, f"rule {self.match!r} scheme"))

    @property
    def kind(self) -> str:
        """"class", "regex" or "glob"."""
        if self.match in MODULE_CLASSES:
            return "class"
        return "regex" if self.match.startswith("re:") else "glob"

    def matches(self, name: str, classes=frozenset()) -> bool:
        """Whether the Linear ``name`` (full module name) with module ``classes`` is selected."""
        kind = self.kind
        if kind == "class":
            return self.match in classes
        if kind == "regex":
            return re.search(self.match[3:], name) is not None
        return fnmatch.fnmatchcase(name, self.match)


@dataclass(frozen=True)
class KVCacheScheme:
    """KV cache: K and V (after RoPE) fake-quantized with calibrated scales s = amax / 448: "fp8-e4m3" (E4M3 of
    x / s), one per layer (or one per KV head with ``per_head``), or "nvfp4" (E2M1 with an E4M3 scale per 16 along
    head_dim, outer encode scale 1 / s: the engines' NVFP4 KV cache, docs/formats.md), one per layer."""

    format: str = "fp8-e4m3"
    per_head: bool = False

    def __post_init__(self):
        if self.format not in KV_CACHE_FORMATS:
            raise UsageError(f"kv_cache format={self.format!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, KV_CACHE_FORMATS))}")
        if not isinstance(self.per_head, bool):
            raise UsageError(f"kv_cache per_head={self.per_head!r}: expected true or false")
        if self.format == "nvfp4" and self.per_head:
            raise UsageError("kv_cache per_head=true with format 'nvfp4': the engines' NVFP4 KV cache takes one "
                             "scale per layer (per_head: false)")

    @property
    def label(self) -> str:
        return "kv " + self.format + (" per-head" if self.per_head else "")


def _is_nvfp4(s: Scheme) -> bool:
    """Whether the scheme's weights are NVFP4 (the schemes ``PTQRecipe.with_nvfp4`` sets options on)."""
    return isinstance(s.weight_spec, NVFP4)


@dataclass(frozen=True)
class PTQRecipe:
    """Which scheme each Linear gets: the first of ``rules`` that matches, else ``default``; Linears
    matching ``ignore`` (regexes, ``re.search``) are kept in high precision. ``kv_cache``: calibrated
    FP8 K / V (None: the KV cache stays in the model dtype)."""

    name: str = "custom"
    description: str = ""
    default: Scheme = Scheme("nvfp4-w4a16")
    rules: tuple[PTQRule, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_EXCLUDE
    kv_cache: Optional[KVCacheScheme] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise UsageError(f"PTQ recipe name={self.name!r}: expected a non-empty string")
        if not isinstance(self.description, str):
            raise UsageError(f"PTQ recipe description={self.description!r}: expected a string")
        object.__setattr__(self, "default", Scheme.from_value(self.default, "default"))
        if isinstance(self.rules, (str, dict)) or not isinstance(self.rules, (list, tuple)):
            raise UsageError(f"rules={self.rules!r}: expected a list of PTQRule")
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, PTQRule):
                raise UsageError(f"rules[{i}]={rule!r}: expected a PTQRule(match, scheme)")
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "ignore", check_regexes(self.ignore, "ignore"))
        if self.kv_cache is not None and not isinstance(self.kv_cache, KVCacheScheme):
            raise UsageError(f"kv_cache={self.kv_cache!r}: expected a KVCacheScheme or None")

    @classmethod
    def single(cls, scheme: Scheme, ignore=DEFAULT_EXCLUDE, name: Optional[str] = None) -> "PTQRecipe":
        """Every Linear (but ``ignore``) gets ``scheme``."""
        scheme = Scheme.from_value(scheme)
        return cls(name=name or scheme.name, description=f"every Linear: {scheme.label}", default=scheme,
                   ignore=tuple(ignore))

    def schemes(self) -> tuple[Scheme, ...]:
        """The distinct schemes the recipe names (default first, then the rules' in order)."""
        out: list[Scheme] = []
        for s in (self.default, *(r.scheme for r in self.rules)):
            if s not in out:
                out.append(s)
        return tuple(out)

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def rule_for(self, name: str, classes=frozenset()) -> tuple[Optional[int], Scheme]:
        """(index of the first matching rule or None for the default, the scheme) of Linear ``name``."""
        for i, rule in enumerate(self.rules):
            if rule.matches(name, classes):
                return i, rule.scheme
        return None, self.default

    @property
    def needs_calibration(self) -> bool:
        """Whether some scheme has calibrated (static) activation scales or Hessian-aware weight block scales,
        or the KV cache is quantized."""
        return self.kv_cache is not None or any(s.static_activations or s.hessian_scales for s in self.schemes())

    @property
    def label(self) -> str:
        """The name and the distinct schemes, e.g. "nvfp4-experts-fp8-attention (nvfp4-w4a4, fp8-w8a8, kv fp8-e4m3)"."""
        parts = [s.label for s in self.schemes()] + ([self.kv_cache.label] if self.kv_cache else [])
        return f"{self.name} ({', '.join(parts)})"

    def with_nvfp4(self, scale_rule: Optional[str] = None, error: Optional[str] = None,
                   act_scale_rule: Optional[str] = None) -> "PTQRecipe":
        """A copy with the given options set on every NVFP4 scheme (``act_scale_rule``: on the W4A4 ones);
        an option no scheme of the recipe takes is a UsageError."""
        changes = {"scale_rule": scale_rule, "error": error, "act_scale_rule": act_scale_rule}
        changes = {k: v for k, v in changes.items() if v is not None}
        if not changes:
            return self
        for option in changes:
            if not any(option in SCHEME_OPTIONS[s.name] and _is_nvfp4(s) for s in self.schemes()):
                takers = ", ".join(n for n in SCHEME_NAMES if option in SCHEME_OPTIONS[n] and _is_nvfp4(Scheme(n)))
                raise UsageError(f"PTQ recipe {self.name!r} has no NVFP4 scheme that takes {option} ({takers}); its "
                                 f"schemes: {', '.join(s.label for s in self.schemes())}")

        def fix(s: Scheme) -> Scheme:
            if not _is_nvfp4(s):
                return s
            return s.replace(**{k: v for k, v in changes.items() if k in SCHEME_OPTIONS[s.name]})

        return dataclasses.replace(self, default=fix(self.default),
                                   rules=tuple(PTQRule(r.match, fix(r.scheme)) for r in self.rules))

    def replace(self, **changes) -> "PTQRecipe":
        return dataclasses.replace(self, **changes)


__all__ = ["KVCacheScheme", "KV_CACHE_FORMATS", "MODULE_CLASSES", "PTQRecipe", "PTQRule", "SCHEME_NAMES",
           "SCHEME_OPTIONS", "Scheme", "check_regexes"]
