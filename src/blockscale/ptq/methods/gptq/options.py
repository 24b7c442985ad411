"""GPTQOptions: the options of ``method="gptq"`` and of ``gptq_quantize``."""
from __future__ import annotations

from dataclasses import dataclass

from ....quant.nvfp4 import BLOCK  # NVFP4 block: 16 consecutive input columns of a row
from ...options import OptionError, check_options, option
FOUR_OVER_SIX_MODES = ("aware", "plain")


@dataclass(frozen=True)
class GPTQOptions:
    """Options of ``gptq_quantize`` (see ``ptq.methods.gptq.algorithm`` for the exact semantics).

    damp: dampening ``damp * mean(diag(H))`` added to H's diagonal, in [0, 1).
    block_size: columns per lazy-batch block (a positive multiple of 16).
    act_order: process columns by decreasing ``diag(H)``; implies ``static_groups``.
    static_groups: fix every block scale up front from the original weights.
    four_over_six: for ``scale_rule="4over6"``: "aware" (choose 4 or 6 per block by the GPTQ loss
      inside the loop) or "plain" (the 4/6 rule on the group's current weights). Ignored for
      other rules, and for static groups (plain 4/6 on the original weights).
    true_sequential: quantize_model quantizes each decoder layer's Linears stage by stage (fused groups in
      dataflow order), each stage's Hessian recorded from the layer with the earlier stages already
      quantized (``ptq.methods.gptq.sequential``); MoE layers are refused.
    rounded_inputs: each Linear that quantizes its inputs (W4A4, W8A8) is GPTQ'd with the Hessian of its inputs
      as its quantized Linear rounds them (its group's calibrated input scale), recorded by a second pass over
      the layer, instead of the unrounded inputs' (weights-only Linears keep theirs); not with true_sequential.
    FP8 / MX Linears of a mixed recipe (``gptq_fixed_grid``) take damp, block_size (rounded up to whole
    32-column MX groups), act_order and static_groups; four_over_six applies to NVFP4 Linears only.
    """

    damp: float = option(0.01, "GPTQ dampening, relative to mean(diag(H))", lo=0.0, hi=1.0, hi_open=True)
    block_size: int = option(128, "GPTQ lazy-batch block: columns, a multiple of 16", lo=16)
    act_order: bool = option(False, "GPTQ processes columns by decreasing diag(H) (implies static groups)")
    static_groups: bool = option(False, "GPTQ fixes every block scale up front from the original weights")
    four_over_six: str = option("aware", "with --scale-rule 4over6: choose 4 or 6 inside the GPTQ loop (aware) "
                                "or by block error (plain)", choices=FOUR_OVER_SIX_MODES, flag="4over6")
    true_sequential: bool = option(False, "GPTQ quantizes a layer's Linears in dataflow order, each one's Hessian "
                                   "recorded with the previous ones quantized (not for MoE layers)")
    rounded_inputs: bool = option(False, "GPTQ weighs each W4A4 / W8A8 Linear's error by the Hessian of its inputs "
                                  "as the quantized Linear rounds them (a second calibration pass per layer)")

    def __post_init__(self):
        check_options(self)
        if self.rounded_inputs and self.true_sequential:
            raise OptionError(type(self).__name__, "rounded_inputs", self.rounded_inputs, "not combined with "
                              "true_sequential (its later stages record their Hessians again, unrounded)")
        if self.block_size % BLOCK:
            raise OptionError(type(self).__name__, "block_size", self.block_size,
                              f"expected a positive multiple of {BLOCK} (whole NVFP4 blocks), e.g. 128")


__all__ = ["BLOCK", "FOUR_OVER_SIX_MODES", "GPTQOptions"]
