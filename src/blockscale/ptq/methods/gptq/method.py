"""``method="gptq"``: GPTQ on each Linear's calibration Hessian, with the group's shared scale: NVFP4
(``gptq_quantize``, with the group's outer scale) or FP8 / MX (``gptq_fixed_grid``: fixed scales).
Fused 3-D MoE experts (``ptq.fused_experts``): one Hessian per expert and projection (gate/up input:
the hidden states routed to the expert, or all with ``calibrate_all_experts``; down input: its
act(gate) * up), each expert's [2I, H] / [H, I] weight GPTQ'd with its outer scale. ``true_sequential``:
the layer's Linears in dataflow stages, each stage's Hessians recorded after the earlier stages are
quantized (``sequential``; quantize_model asks ``quantize_stages``). ``rounded_inputs``: the Hessians of the
Linears that quantize their inputs come from the rounded inputs (quantize_model records them again)."""
from __future__ import annotations

from ....quant import NVFP4
from ...protocol import PTQMethod, QuantizedWeight
from ...statistics import StatisticsRequest
from .algorithm import gptq_quantize
from .fixed_grid import gptq_fixed_grid
from .options import GPTQOptions
from .sequential import check_true_sequential, dataflow_stages


class GPTQ(PTQMethod):
    """Records each Linear's Hessian; quantizes with ``gptq_quantize`` (RTN, with a note, for a Linear
    that saw no calibration tokens, or an expert no token was routed to). The report compares each
    Linear's (and expert's) output error with RTN's."""

    name = "gptq"
    Options = GPTQOptions
    flag_prefix = "gptq"
    quantizes_with_statistics = True
    compares_to_rtn = True
    quantizes_fused_experts = True
    chooses_block_scales = True
    weighs_block_scales = True

    def __init__(self, options=None):
        super().__init__(options)
        self.hessian_of_rounded_inputs = self.options.rounded_inputs

    def statistics(self) -> StatisticsRequest:
        return StatisticsRequest(hessian=True)

    def check_layer(self, layer, name: str) -> None:
        if self.options.true_sequential:
            check_true_sequential(layer, name)

    def quantize_stages(self, layer, linears, inputs, device):
        """With ``true_sequential``: the layer's Linears in dataflow stages (``sequential.dataflow_stages``)."""
        if not self.options.true_sequential or not linears:
            return None
        return dataflow_stages(layer, linears, inputs, device)

    def quantize_weight(self, weight, stats, spec, encode_scale) -> QuantizedWeight:
        H = stats.H if stats is not None else None
        if H is None:
            return QuantizedWeight(super().quantize_weight(weight, stats, spec, encode_scale).q,
                                   "no calibration tokens: RTN")
        if isinstance(spec, NVFP4):
            q, stats = gptq_quantize(weight, H, spec, encode_scale, self.options)
        else:
            q, stats = gptq_fixed_grid(weight, H, spec, encode_scale, self.options)
        return QuantizedWeight(q, latent=stats["latent"])  # the values it rounded: scale learning's latent

    def quantize_weight_weighted(self, weight, stats, spec, encode_scale, rule: str) -> QuantizedWeight:
        """GPTQ with the Hessian-aware scale ``rule`` ("hessian" / "hessian-4over6"): each group's block scales
        are the rule's, weighted by the channel weights of the GPTQ loss (``gptq_quantize(weighted_rule=)``),
        chosen from the current (error-corrected) weights. No calibration tokens: RTN with the base rule."""
        H = stats.H if stats is not None else None
        if H is None:
            return QuantizedWeight(super().quantize_weight(weight, stats, spec, encode_scale).q,
                                   f"no calibration tokens: RTN ({rule} fell back to {spec.scale_rule})")
        q, st = gptq_quantize(weight, H, spec, encode_scale, self.options, weighted_rule=rule)
        return QuantizedWeight(q, latent=st["latent"])


__all__ = ["GPTQ"]
