"""PTQConfig: what post-training quantization does to a model (method, scale rule, activations)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from ..quant import NVFP4
from ..quant.specs import _check
from ..recipes.recipe import DEFAULT_EXCLUDE, check_patterns  # embeddings, the output head, MoE routers: as in training

METHODS = ("rtn", "awq", "smoothquant", "gptq")
WEIGHT_SCALE_RULES = ("6", "4over6", "sweep")
ACTIVATIONS = ("w4a16", "w4a4")
FOUR_OVER_SIX_GPTQ = ("aware", "plain")

@dataclass(frozen=True)
class PTQConfig:
    """Post-training quantization of every nn.Linear in a model's decoder layers to NVFP4.

    method: "rtn" (round to nearest with the scale rule), "awq" (activation-aware per-input-channel
      scales searched against the quantized output error, folded into the previous norm / linear),
      "smoothquant" (static s = max|X|^alpha / max|W|^(1-alpha), folded), "gptq" (Hessian-based
      error feedback with NVFP4 block scales).
    scale_rule / error: weight block scales: "6", "4over6" (with the 4/6 block error "mse" | "mae" |
      "maxabs"), "sweep" (all 126 E4M3 scales, least squared error).
    activations: "w4a16" (weights only) or "w4a4" (NVFP4 activations: dynamic per-16 block scales,
      one calibrated outer scale per layer); act_scale_rule "6" or "4over6" for the activations.
    exclude: regexes on module names kept in high precision (lm_head, embeddings by default).
    skip_indivisible: keep Linears whose in_features is not a multiple of 16 in high precision (with a
      warning in the report) instead of raising.
    allow_partial: quantize what can be even when more than half of the decoder layers' weight
      elements stay in high precision (e.g. fused 3-D MoE experts, which PTQ does not quantize);
      otherwise that is a QuantizationError before calibrating. Either way the report lists them.
    Fused groups (q/k/v, gate/up, w1/w3) always share one weight outer scale.
    """

    method: str = "rtn"
    scale_rule: str = "6"
    error: str = "mse"
    activations: str = "w4a16"
    act_scale_rule: str = "6"
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    skip_indivisible: bool = False
    allow_partial: bool = False
    # calibration
    n_samples: int = 128
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    # method options
    awq_grid: int = 20
    awq_duo_scaling: bool = True
    awq_max_tokens: int = 4096
    smoothquant_alpha: float = 0.5
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    gptq_static_groups: bool = False
    gptq_four_over_six: str = "aware"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        _check("method", self.method, METHODS)
        _check("scale_rule", self.scale_rule, WEIGHT_SCALE_RULES)
        _check("activations", self.activations, ACTIVATIONS)
        _check("act_scale_rule", self.act_scale_rule, ("6", "4over6"))
        _check("gptq_four_over_six", self.gptq_four_over_six, FOUR_OVER_SIX_GPTQ)
        NVFP4(scale_rule=self.scale_rule, error=self.error)  # validates error
        object.__setattr__(self, "exclude", check_patterns(self.exclude))
        for name in ("skip_indivisible", "allow_partial", "awq_duo_scaling", "gptq_act_order", "gptq_static_groups"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name}={getattr(self, name)!r}: expected True or False")
        for name in ("n_samples", "seq_len", "batch_size", "awq_grid", "awq_max_tokens", "gptq_block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{name}={v!r}: expected a positive int")
        if self.seq_len < 2:
            raise UsageError(f"seq_len={self.seq_len}: need at least 2 tokens")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise UsageError(f"smoothquant_alpha={self.smoothquant_alpha}: must be in [0, 1]")
        if not 0.0 <= self.gptq_damp < 1.0:
            raise UsageError(f"gptq_damp={self.gptq_damp}: must be in [0, 1)")

    @property
    def weight_spec(self) -> NVFP4:
        return NVFP4(scale_rule=self.scale_rule, error=self.error)

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn" or self.activations == "w4a4"

    @property
    def label(self) -> str:
        """Short name for tables: e.g. "gptq 4over6-mse w4a4"."""
        rule = self.scale_rule + (f"-{self.error}" if self.scale_rule == "4over6" else "")
        act = self.activations + (f" a:{self.act_scale_rule}" if self.activations == "w4a4" and self.act_scale_rule != "6" else "")
        return f"{self.method} {rule} {act}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exclude"] = list(self.exclude)
        return d


__all__ = ["ACTIVATIONS", "DEFAULT_EXCLUDE", "METHODS", "PTQConfig", "WEIGHT_SCALE_RULES"]
