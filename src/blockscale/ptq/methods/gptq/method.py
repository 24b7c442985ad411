"""``method="gptq"``: GPTQ on each Linear's calibration Hessian, with the group's outer scale."""
from __future__ import annotations

from ...protocol import PTQMethod, QuantizedWeight
from ...statistics import StatisticsRequest
from .algorithm import gptq_quantize
from .options import GPTQOptions


class GPTQ(PTQMethod):
    """Records each Linear's Hessian; quantizes with ``gptq_quantize`` (RTN, with a note, for a Linear
    that saw no calibration tokens). The report compares each Linear's output error with RTN's."""

    name = "gptq"
    Options = GPTQOptions
    flag_prefix = "gptq"
    quantizes_with_statistics = True
    compares_to_rtn = True

    def statistics(self) -> StatisticsRequest:
        return StatisticsRequest(hessian=True)

    def quantize_weight(self, weight, stats, spec, encode_scale) -> QuantizedWeight:
        H = stats.H if stats is not None else None
        if H is None:
            return QuantizedWeight(super().quantize_weight(weight, stats, spec, encode_scale).q,
                                   "no calibration tokens: RTN")
        q, _ = gptq_quantize(weight, H, spec, encode_scale, self.options)
        return QuantizedWeight(q)


__all__ = ["GPTQ"]
