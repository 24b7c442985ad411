"""Automatic mixed precision under a bits budget: a PTQ recipe chosen per unit from calibration sensitivities.

    result = auto_recipe(model, calibration_ids, AutoRecipeConfig(effective_bits=6))
    result.recipe      # a PTQRecipe: one rule per unit ("re:^<exact module names>$" -> its scheme), default bf16
    print("\\n".join(result.lines()))   # the report table
    result.yaml()      # the recipe as YAML (``quantize --recipe FILE.yaml`` reads it back)

Every unit (``units``: a Linear, a fused sibling group, all experts of one MoE experts module) gets one of the
candidate schemes (only schemes both checkpoint formats store; by default all of them: NVFP4 W4A4, NVFP4 W4A16, FP8
W8A8, MXFP8, bf16). Each (unit, candidate) has a score (``sensitivity``: the diagonal-Fisher estimate of the loss increase,
or the output error) and a cost (``costs``: stored bits, scales included); a MILP (``solver``, SciPy's
``milp``) picks the assignment of least summed score whose effective bits per weight, over all parameters of
the units (``cost="total"``) or those an average token uses (``cost="active"``: routed experts weighted by
their measured routing frequency), stay within ``effective_bits``. Scores are for round-to-nearest weights;
PTQ then runs its own method (``--method``) with the recipe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import yaml
from torch import nn

from ...errors import DataError, UsageError
from ...nn.kv_cache import attention_modules
from ...recipes.ptq_recipe import SCHEME_NAMES, PTQRecipe, PTQRule, Scheme, check_regexes
from ...recipes.ptq_serialize import ptq_recipe_to_dict, save_ptq_recipe
from ...recipes.recipe import DEFAULT_EXCLUDE
from ..export_check import check_recipe_exportable
from ..preflight import vocab_size
from .kv_cache import KV_BITS, KV_CANDIDATES, KVChoice, KVTap, choose_kv, kv_candidates, kv_choice, kv_why_not
from .costs import COSTS, bits_per_weight, cost_table, effective_bits, unit_bits, unit_weights
from .report import ReportRow, table
from .sensitivity import ESTIMATORS, Sensitivity, measure
from .solver import brute_force, cheapest, dearest, fits, solve
from .units import Unit, find_units, why_not

EXPORT_FORMATS = ("compressed-tensors", "modelopt")  # a candidate must be storable in both


def _storable(scheme: Scheme) -> Optional[str]:
    """Why a checkpoint format cannot store ``scheme`` (``ptq.export_check``), or None."""
    for fmt in EXPORT_FORMATS:
        try:
            check_recipe_exportable(PTQRecipe.single(scheme), fmt)
        except UsageError as e:
            return str(e)
    return None


def storable_schemes() -> tuple[str, ...]:
    """The scheme names (with default options) both checkpoint formats store: the allowed candidates."""
    return tuple(n for n in SCHEME_NAMES if _storable(Scheme(n)) is None)


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UsageError(f"{name}={v!r}: expected a positive int")


@dataclass(frozen=True)
class AutoRecipeConfig:
    """What ``auto_recipe`` optimises.

    effective_bits: the budget, stored bits per weight (scales included) averaged over the counted parameters.
    candidates: the schemes a unit may get: names ("nvfp4-w4a4") or ``Scheme``s (options set), a list or a
      comma-separated string; each must be storable by both compressed-tensors and ModelOpt. None (default):
      every scheme both store, with default options (``storable_schemes``: nvfp4-w4a4, nvfp4-w4a16, fp8-w8a8,
      mxfp8, bf16).
    estimator: "fisher" (gradient-weighted output error: the estimated loss increase) or "output" (plain output
      error); see ``sensitivity``.
    cost: "total" (every parameter of the units counts) or "active" (the parameters an average token uses:
      routed experts by their measured routing frequency).
    n_samples / seq_len: at most this many calibration windows / tokens per window are used (the command line
      draws exactly these); batch_size: windows per forward / backward pass; seed: the torch RNG seed during
      the passes (and of the command line's calibration windows).
    ignore: regexes (``re.search`` on full module names) kept in high precision and out of the budget, as a
      recipe's ``ignore`` (it becomes the recipe's). name: the recipe's name.
    kv_cache_bits: None (default: no KV cache in the recipe) or the KV cache's budget in bits per cached element:
      the recipe's ``kv_cache`` is then the KV candidate of least score within it (``kv_cache``: bf16 16, FP8 8,
      NVFP4 4.5 bits), scored by the same estimator in the same passes. kv_candidates: the KV candidates
      (names of ``kv_cache.KV_CANDIDATES``, a list or comma-separated; default all), only with kv_cache_bits.
    """

    effective_bits: float
    candidates: Optional[tuple] = None
    estimator: str = "fisher"
    cost: str = "total"
    n_samples: int = 128
    seq_len: int = 512
    batch_size: int = 4
    seed: int = 0
    ignore: tuple = DEFAULT_EXCLUDE
    name: str = "auto"
    kv_cache_bits: Optional[float] = None
    kv_candidates: Optional[tuple] = None

    def __post_init__(self):
        b = self.effective_bits
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise UsageError(f"effective_bits={b!r}: expected a finite number of bits per weight > 0 (e.g. 6)")
        object.__setattr__(self, "effective_bits", float(b))
        object.__setattr__(self, "candidates", self._candidates(self.candidates))
        for name, allowed in (("estimator", ESTIMATORS), ("cost", COSTS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"{name}={getattr(self, name)!r} is not supported; allowed values: "
                                 f"{', '.join(map(repr, allowed))}")
        for name in ("n_samples", "seq_len", "batch_size"):
            _positive_int(name, getattr(self, name))
        if self.seq_len < 2:
            raise UsageError(f"seq_len={self.seq_len}: need at least 2 tokens (the loss predicts the next one)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed={self.seed!r}: expected an int >= 0")
        object.__setattr__(self, "ignore", check_regexes(self.ignore, "ignore"))
        if not isinstance(self.name, str) or not self.name.strip():
            raise UsageError(f"name={self.name!r}: expected a non-empty string")
        kb = self.kv_cache_bits
        if kb is None:
            if self.kv_candidates is not None:
                raise UsageError("kv_candidates needs kv_cache_bits (the KV cache's budget, bits per cached element)")
        else:
            if isinstance(kb, bool) or not isinstance(kb, (int, float)) or not math.isfinite(kb) or kb <= 0:
                raise UsageError(f"kv_cache_bits={kb!r}: expected a finite number of bits per cached element > 0 "
                                 f"(bf16 {KV_BITS['bf16']:g}, FP8 {KV_BITS['fp8-e4m3']:g}, NVFP4 {KV_BITS['nvfp4']:g})")
            object.__setattr__(self, "kv_cache_bits", float(kb))
            object.__setattr__(self, "kv_candidates", kv_candidates(self.kv_candidates))

    @staticmethod
    def _candidates(value) -> tuple[Scheme, ...]:
        allowed = ", ".join(map(repr, storable_schemes()))
        if value is None:
            value = storable_schemes()
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",")]
        if not isinstance(value, (list, tuple)) or not value:
            raise UsageError(f"candidates={value!r}: expected a non-empty list of schemes; allowed values: {allowed}")
        out: list[Scheme] = []
        for v in value:
            try:
                s = Scheme.from_value(v, "candidates")
            except UsageError as e:
                raise UsageError(f"{e} (candidates: any of {allowed})") from None
            why = _storable(s)
            if why is not None:
                raise UsageError(f"candidates: {s.label} cannot be a candidate, a checkpoint format cannot store it "
                                 f"({why}); allowed values: {allowed}")
            if s in out or s.label in [o.label for o in out]:
                raise UsageError(f"candidates: {s.label} is given twice")
            out.append(s)
        return tuple(out)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(s.label for s in self.candidates)


@dataclass(frozen=True)
class AutoRecipeResult:
    """``recipe``: the chosen PTQRecipe; ``report``: one ``ReportRow`` per unit; ``effective_bits``: achieved,
    as ``config.cost`` counts; ``total_bits`` / ``active_bits``: the same assignment counted over all / the active
    parameters; ``objective``: the summed score; ``notes``: remarks (e.g. a budget that does not bind);
    ``units`` and ``sensitivity``: what they came from; ``kv``: the KV cache choice (with ``kv_cache_bits``)."""

    config: AutoRecipeConfig
    recipe: PTQRecipe
    report: tuple[ReportRow, ...]
    effective_bits: float
    total_bits: float
    active_bits: float
    objective: float
    notes: tuple[str, ...]
    units: tuple[Unit, ...]
    sensitivity: Sensitivity
    kv: Optional[KVChoice] = None

    def lines(self) -> list[str]:
        """The report table (``report.table``) and the notes."""
        c = self.config
        return table(self.report, c.labels, estimator=c.estimator, cost=c.cost, budget=c.effective_bits,
                     achieved=self.effective_bits, objective=self.objective,
                     tokens=self.sensitivity.tokens) + (self.kv.lines() if self.kv else []) \
            + [f"note: {n}" for n in self.notes]

    def yaml(self) -> str:
        """The recipe as YAML (what ``save`` writes; ``recipes.get_ptq_recipe(path)`` reads it back)."""
        return yaml.safe_dump(ptq_recipe_to_dict(self.recipe), sort_keys=False)

    def save(self, path) -> None:
        save_ptq_recipe(self.recipe, path)

    def to_dict(self) -> dict:
        """JSON-ready: budget, estimator, cost, candidates, achieved bits, the rows, the notes."""
        c = self.config
        return {"effective_bits_budget": c.effective_bits, "estimator": c.estimator, "cost": c.cost,
                "candidates": list(c.labels), "effective_bits": self.effective_bits, "total_bits": self.total_bits,
                "active_bits": self.active_bits, "objective": self.objective,
                "calibration_tokens": self.sensitivity.tokens, "routed_tokens": self.sensitivity.routed,
                "units": [r.to_dict() for r in self.report], "notes": list(self.notes),
                "kv_cache": self.kv.to_dict() if self.kv else None,
                "recipe": ptq_recipe_to_dict(self.recipe)}


def _calibration(model: nn.Module, ids, config: AutoRecipeConfig) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        what = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise DataError(f"calibration_ids must be a [n, T] long tensor, got {what}")
    ids = ids[:config.n_samples, :config.seq_len]
    if ids.shape[0] < 1 or ids.shape[1] < 2:
        raise DataError(f"calibration_ids has shape {tuple(ids.shape)}: need at least one window of 2 tokens")
    vocab = vocab_size(model)
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise DataError(f"calibration token ids must be in [0, {vocab}) (the model's vocabulary size); got min "
                        f"{int(ids.min())}, max {int(ids.max())}")
    return ids


def _check_budget(costs, budget: float) -> None:
    low = cheapest(costs)
    if not fits(low, budget):
        raise UsageError(f"effective_bits={budget:g} is below the cheapest assignment of these candidates "
                         f"({low:.4f} bits per weight, every unit at its cheapest allowed scheme); allowed: "
                         f"effective_bits >= {low:.4f} (or cheaper candidates)")


def build_recipe(units, schemes, config: AutoRecipeConfig, description: str = "", kv_cache=None) -> PTQRecipe:
    """One rule per unit (its exact-name ``match`` -> its scheme), default bf16 (nothing else is quantized),
    ``config.ignore`` as the ignore list, ``kv_cache`` (a KVCacheScheme or None) as the KV cache."""
    return PTQRecipe(name=config.name, description=description, default=Scheme("bf16"),
                     rules=tuple(PTQRule(u.match, s) for u, s in zip(units, schemes)), ignore=config.ignore,
                     kv_cache=kv_cache)


def _kv_tap(model: nn.Module, config: AutoRecipeConfig) -> Optional[KVTap]:
    """The KV candidates' tap (None without ``kv_cache_bits``); the KV budget checked before measuring."""
    if config.kv_cache_bits is None:
        return None
    names, attn = config.kv_candidates, attention_modules(model)
    if not attn:
        raise UsageError(f"kv_cache_bits: {type(model).__name__} has no attention module whose KV cache blockscale "
                         "quantizes (transformers attention modules with k_proj / v_proj and a layer_idx)")
    allowed = [kv_why_not(n, attn) is None for n in names]
    choose_kv(names, [0.0 if ok else None for ok in allowed], config.kv_cache_bits)  # UsageError if none fits
    return KVTap(model, names, allowed)


def auto_recipe(model: nn.Module, calibration_ids: torch.Tensor, config: AutoRecipeConfig) -> AutoRecipeResult:
    """The PTQ recipe of least summed sensitivity within ``config.effective_bits`` (module docstring) for
    ``model`` (a causal LM whose decoder layers PTQ finds), measured on ``calibration_ids`` ([n, T] token ids;
    the first ``n_samples`` windows and ``seq_len`` tokens). UsageError for a budget below the cheapest
    assignment or a unit no candidate fits; a budget at or above the most expensive assignment is a note (every
    unit gets its lowest-score candidate)."""
    if not isinstance(config, AutoRecipeConfig):
        raise UsageError(f"config must be an AutoRecipeConfig, got {type(config).__name__}")
    ids = _calibration(model, calibration_ids, config)
    units = find_units(model, config.ignore)
    if not units:
        raise UsageError(f"no quantizable unit (Linear, fused group or experts module in the decoder layers, outside "
                         f"ignore={list(config.ignore)!r}) in {type(model).__name__}")
    cands = config.candidates
    reasons = [[why_not(u, s) for s in cands] for u in units]
    allowed = [[r is None for r in row] for row in reasons]
    for u, row in zip(units, reasons):
        if all(r is not None for r in row):
            raise UsageError(f"candidates: none fits {u.name} ({'; '.join(f'{s.label}: {r}' for s, r in zip(cands, row))}); "
                             "add a scheme without blocks (bf16, fp8-w8a8) to candidates, or ignore it")
    if config.cost == "total":  # the budget checked before measuring (active: the routing decides the weights)
        _check_budget(cost_table(units, cands, unit_weights(units, None, "total"), allowed), config.effective_bits)
    kv_tap = _kv_tap(model, config)
    sens = measure(model, units, cands, allowed, ids, config.estimator, config.batch_size, config.seed, kv_tap)
    kv = kv_choice(config.kv_candidates, sens.kv_scores, config.kv_cache_bits) if kv_tap is not None else None
    weights = unit_weights(units, sens.active_fraction, config.cost)
    costs = cost_table(units, cands, weights, allowed)
    budget, high = config.effective_bits, dearest(costs)
    _check_budget(costs, budget)
    notes = []
    if budget >= high:
        notes.append(f"effective_bits={budget:g} is at or above the most expensive assignment ({high:.4f} bits per "
                     "weight): the budget does not bind, every unit gets its lowest-score candidate")
    scores = [[v if v is not None else 0.0 for v in row] for row in sens.scores]
    best = solve(scores, costs, budget)
    chosen = [cands[c] for c in best.choice]
    counts = {"total": unit_weights(units, sens.active_fraction, "total"),
              "active": unit_weights(units, sens.active_fraction, "active")}
    total_bits, active_bits = (effective_bits(units, chosen, counts[k]) for k in ("total", "active"))
    desc = (f"auto-recipe: {len(units)} units, {config.estimator} scores on {sens.tokens} calibration tokens, "
            f"effective bits {best.cost:.4f} of budget {budget:g} (cost {config.cost}); candidates "
            f"{', '.join(config.labels)}" + (f"; KV cache {kv.chosen} (budget {kv.budget:g} bits per element)"
                                            if kv else ""))
    rows = tuple(ReportRow(u.name, u.kind, u.match, u.params, w, tuple(sens.scores[i]),
                           tuple(bits_per_weight_of(u, s) if ok else None for s, ok in zip(cands, allowed[i])),
                           cands[best.choice[i]].label)
                 for i, (u, w) in enumerate(zip(units, weights)))
    return AutoRecipeResult(config, build_recipe(units, chosen, config, desc, kv.kv_cache if kv else None), rows,
                            best.cost, total_bits, active_bits, best.objective, tuple(notes), tuple(units), sens, kv)


def bits_per_weight_of(unit: Unit, scheme: Scheme) -> float:
    """Stored bits per weight of ``unit`` under ``scheme`` (all its Linears, scales included)."""
    return unit_bits(unit, scheme) / unit.params


__all__ = ["AutoRecipeConfig", "AutoRecipeResult", "EXPORT_FORMATS", "KVChoice", "KV_CANDIDATES", "ReportRow", "Unit",
           "auto_recipe", "bits_per_weight", "bits_per_weight_of", "brute_force", "build_recipe", "find_units",
           "solve", "storable_schemes"]
