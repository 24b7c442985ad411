"""PTQConfig: what post-training quantization does to a model (method and its options, scale rule,
activations, what to exclude, calibration)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError
from ..quant import NVFP4
from ..quant.nvfp4.weighted import WEIGHTED_RULES
from ..recipes.ptq_builtin import get_ptq_recipe
from ..recipes.ptq_recipe import PTQRecipe, Scheme
from ..recipes.ptq_serialize import ptq_recipe_to_dict
from ..recipes.recipe import DEFAULT_EXCLUDE, check_patterns  # embeddings, the output head, MoE routers: as in training
from .fused_experts import OUTER_SCALE_MODES
from .hessian_scales import HessianScales
from .methods import METHODS, get_method
from .protocol import PTQMethod
from .rotations.plan import RotationPlan, parse_rotate

WEIGHT_SCALE_RULES = ("6", "4over6", "sweep", "hessian", "hessian-4over6")
ACTIVATIONS = ("w4a16", "w4a4")
ACT_SCALE_RULES = ("6", "4over6")
EXPERT_OUTER_SCALES = OUTER_SCALE_MODES  # "expert", "tensor"


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise UsageError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class PTQConfig:
    """Post-training quantization of every nn.Linear in a model's decoder layers to NVFP4.

    method: a registered method (``ptq.methods.METHODS``): "rtn" (round to nearest with the scale
      rule), "awq" (activation-aware per-input-channel scales searched against the quantized output
      error, folded into the previous norm / linear), "smoothquant" (static s = max|X|^alpha /
      max|W|^(1-alpha), folded), "gptq" (Hessian-based error feedback with NVFP4 block scales).
    options: the method's options dataclass (``AWQOptions``, ``SmoothQuantOptions``, ``GPTQOptions``,
      ``RTNOptions``); None: its defaults. E.g. ``PTQConfig(method="gptq", options=GPTQOptions(block_size=32))``.
    scale_rule / error: weight block scales: "6", "4over6" (with the 4/6 block error "mse" | "mae" |
      "maxabs"), "sweep" (all 126 E4M3 scales, least squared error), "hessian" / "hessian-4over6" (the
      sweep's / 4/6's candidates, least error weighted by the calibration inputs' per-channel mean x^2:
      Hessian-aware block scales, ``ptq.hessian_scales``; they calibrate even for W4A16).
    activations: "w4a16" (weights only) or "w4a4" (NVFP4 activations: dynamic per-16 block scales,
      one calibrated outer scale per layer); act_scale_rule "6" or "4over6" for the activations.
    exclude: regexes on module names kept in high precision (lm_head, embeddings by default).
    skip_indivisible: keep Linears whose in_features is not a multiple of 16 in high precision (with a
      warning in the report) instead of raising.
    allow_partial: quantize what can be even when more than half of the decoder layers' weight
      elements stay in high precision (e.g. excluded experts, fused layouts PTQ does not know);
      otherwise that is a QuantizationError before calibrating. Either way the report lists them.
    recipe: a PTQ recipe (``recipes.PTQRecipe``, or a built-in name / YAML path): per-module schemes
      (NVFP4, FP8, MX, bf16), its ignore list and FP8 KV cache. None: the flat fields above (scale_rule,
      error, activations, act_scale_rule, exclude) describe a one-scheme NVFP4 recipe, as before. With a
      recipe those fields must stay at their defaults (set the options on the recipe's schemes, e.g.
      ``recipe.with_nvfp4(scale_rule="sweep")``, and its ``ignore``). ``ptq_recipe``: the effective one.
    Fused groups (q/k/v, gate/up, w1/w3) always share one weight outer scale.
    calibrate_all_experts: MoE experts' statistics (GPTQ Hessians, AWQ samples, SmoothQuant / W4A4
      amax) from every calibration token run through every expert, for statistics only (the layer's
      output, hence the next layer's inputs, stay the routed ones); False: each expert sees the tokens
      routed to it. Applies to fused 3-D experts and to the per-expert nn.Linear layout.
    expert_outer_scale: the weight outer scale of MoE experts (NVFP4 outer scale, FP8 tensor scale): "expert" (one per expert and
      projection; gate/up of one expert share theirs) or "tensor" (one per projection shared by all the
      module's experts: ``shared_outer_scale`` over every expert's gate+up rows, and over every down).
      The per-expert nn.Linear layout (``<m>.experts.{e}.w1`` ...) follows it too: "expert" shares
      w1/w3 (gate/up) per expert, "tensor" shares one over every expert's w1/w3 and one over every w2.
    Both are in ``to_dict`` only when not at their defaults.
    """

    method: str = "rtn"
    scale_rule: str = "6"
    error: str = "mse"
    activations: str = "w4a16"
    act_scale_rule: str = "6"
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    recipe: Optional[PTQRecipe] = None
    skip_indivisible: bool = False
    allow_partial: bool = False
    calibrate_all_experts: bool = False
    expert_outer_scale: str = "expert"
    # calibration
    n_samples: int = 128
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    rotate: str = "none"
    rotation_seed: int = 0
    # the method's own options (None: its defaults)
    options: Any = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        cls = get_method(self.method)
        _choice("scale_rule", self.scale_rule, WEIGHT_SCALE_RULES)
        _choice("activations", self.activations, ACTIVATIONS)
        _choice("act_scale_rule", self.act_scale_rule, ACT_SCALE_RULES)
        NVFP4(scale_rule=WEIGHTED_RULES[self.scale_rule].scale_rule if self.scale_rule in WEIGHTED_RULES
              else self.scale_rule, error=self.error)  # validates error
        if self.scale_rule == "hessian-4over6" and self.error != "mse":
            raise UsageError(f"error={self.error!r} cannot be combined with scale_rule='hessian-4over6' (its block "
                             "error is the d-weighted squared error); leave error at 'mse'")
        object.__setattr__(self, "exclude", check_patterns(self.exclude))
        self._check_recipe()
        if self.options is None:
            object.__setattr__(self, "options", cls.Options())
        elif not isinstance(self.options, cls.Options):
            raise UsageError(f"options is a {type(self.options).__name__}, but method={self.method!r} takes "
                             f"{cls.Options.__name__} (pass options={cls.Options.__name__}(...), or leave options "
                             "out for its defaults)")
        object.__setattr__(self, "options", cls.resolve_options(self.options, self.ptq_recipe.schemes()))
        _choice("expert_outer_scale", self.expert_outer_scale, EXPERT_OUTER_SCALES)
        object.__setattr__(self, "rotate", parse_rotate(self.rotate, self.rotation_seed).label)  # validates both
        for name in ("skip_indivisible", "allow_partial", "calibrate_all_experts"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name}={getattr(self, name)!r}: expected True or False")
        for name in ("n_samples", "seq_len", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{name}={v!r}: expected a positive int")
        if self.seq_len < 2:
            raise UsageError(f"seq_len={self.seq_len}: need at least 2 tokens")

    def _check_recipe(self) -> None:
        if self.recipe is None:
            return
        if isinstance(self.recipe, (str, Path)):
            object.__setattr__(self, "recipe", get_ptq_recipe(self.recipe))
        if not isinstance(self.recipe, PTQRecipe):
            raise UsageError(f"recipe={self.recipe!r}: expected a PTQRecipe, a built-in PTQ recipe name or a "
                             "YAML path (or None)")
        flat = {"scale_rule": "6", "error": "mse", "activations": "w4a16", "act_scale_rule": "6",
                "exclude": DEFAULT_EXCLUDE}
        changed = [k for k, v in flat.items() if getattr(self, k) != v]
        if changed:
            raise UsageError(f"{', '.join(changed)} cannot be combined with recipe={self.recipe.name!r}: the recipe "
                             "sets each scheme's options and its ignore list (use recipe.with_nvfp4(scale_rule=..., "
                             "error=..., act_scale_rule=...) or recipe.replace(ignore=...))")

    @property
    def ptq_recipe(self) -> PTQRecipe:
        """The effective PTQ recipe: ``recipe``, or (None) the one NVFP4 scheme the flat fields describe."""
        if self.recipe is not None:
            return self.recipe
        w4a4 = self.activations == "w4a4"
        scheme = Scheme("nvfp4-w4a4" if w4a4 else "nvfp4-w4a16", self.scale_rule, self.error,
                        self.act_scale_rule if w4a4 else None)
        return PTQRecipe.single(scheme, ignore=self.exclude)

    @property
    def weight_spec(self) -> NVFP4:
        """The NVFP4 weight spec of the flat fields; with a recipe, that of its default scheme when it is
        NVFP4 (per-module schemes: ``scheme_plan.assign_schemes``)."""
        if self.recipe is not None:
            if not isinstance(self.recipe.default.weight_spec, NVFP4):
                raise UsageError(f"recipe {self.recipe.name!r}: its default scheme {self.recipe.default.label} is not "
                                 "NVFP4; take each module's weight spec from its scheme")
            return self.recipe.default.weight_spec
        if self.scale_rule in WEIGHTED_RULES:  # the stored format of a Hessian-aware rule
            return WEIGHTED_RULES[self.scale_rule]
        return NVFP4(scale_rule=self.scale_rule, error=self.error)

    def make_method(self) -> PTQMethod:
        """The method object (``METHODS[method](options)``) whose steps ``quantize_model`` runs; wrapped by
        ``hessian_scales.HessianScales`` when a scheme has Hessian-aware block scales."""
        method = METHODS[self.method](self.options)
        if any(s.hessian_scales for s in self.ptq_recipe.schemes()):
            return HessianScales(method)
        return method

    @property
    def rotation_plan(self) -> RotationPlan:
        """The rotations applied before PTQ (``rotations.parse_rotate(rotate, rotation_seed)``)."""
        return parse_rotate(self.rotate, self.rotation_seed)

    @property
    def needs_calibration(self) -> bool:
        return METHODS[self.method].calibrates or self.ptq_recipe.needs_calibration

    @property
    def label(self) -> str:
        """Short name for tables: e.g. "gptq 4over6-mse w4a4"; with a recipe "rtn fp8 (fp8-w8a8)"; then
        " experts:tensor" / " calibrate-all-experts" when set."""
        if self.recipe is not None:
            return f"{self.method} {self.recipe.label}" + self._experts_label
        rule = self.scale_rule + (f"-{self.error}" if self.scale_rule == "4over6" else "")
        act = self.activations + (f" a:{self.act_scale_rule}" if self.activations == "w4a4" and self.act_scale_rule != "6" else "")
        return f"{self.method} {rule} {act}" + self._experts_label

    @property
    def _experts_label(self) -> str:
        """The label's tail: ' experts:tensor' / ' calibrate-all-experts' when set, else ''."""
        return ((" experts:tensor" if self.expert_outer_scale == "tensor" else "")
                + (" calibrate-all-experts" if self.calibrate_all_experts else "")
                + (f" rotate:{self.rotate}" if self.rotate != "none" else ""))

    def to_dict(self) -> dict:
        """Every field; ``options`` as a dict of the method's options; ``recipe`` (only when given) as
        ``recipes.ptq_recipe_to_dict`` writes it; ``calibrate_all_experts`` / ``expert_outer_scale`` only
        when not at their defaults."""
        d = asdict(self)
        for name, default in (("calibrate_all_experts", False), ("expert_outer_scale", "expert"), ("rotate", "none"),
                              ("rotation_seed", 0)):
            if d[name] == default:
                del d[name]
        d["exclude"] = list(self.exclude)
        if self.recipe is None:
            del d["recipe"]
        else:
            d["recipe"] = ptq_recipe_to_dict(self.recipe)
        return d


__all__ = ["ACTIVATIONS", "ACT_SCALE_RULES", "DEFAULT_EXCLUDE", "EXPERT_OUTER_SCALES", "METHODS", "PTQConfig",
           "WEIGHT_SCALE_RULES"]
