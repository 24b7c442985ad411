"""What of a model is quantized: quantized-Linear (NVFP4 / FP8 / MX) weight elements vs floating-point
weight matrices left in high precision (nn.Linear, fused 3-D expert tensors, routers, ...). Used by
PTQ reports and by export, so neither ever claims more than was done."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .quantized_experts import QuantizedExperts
from .quantized_modules import is_quantized_linear


@dataclass(frozen=True)
class Coverage:
    """quantized: quantized Linear / QuantizedExperts name -> weight elements; high_precision: module
    name -> elements of the floating-point parameters of >= 2 dims it owns directly (its own, not its
    children's)."""

    quantized: dict = field(default_factory=dict)
    high_precision: dict = field(default_factory=dict)

    @property
    def quantized_elements(self) -> int:
        return sum(self.quantized.values())

    @property
    def high_precision_elements(self) -> int:
        return sum(self.high_precision.values())

    @property
    def high_precision_fraction(self) -> float:
        """Share of the weight-matrix elements that stay in high precision (0 when there are none)."""
        total = self.quantized_elements + self.high_precision_elements
        return self.high_precision_elements / total if total else 0.0


def weight_coverage(module: nn.Module, prefix: str = "") -> Coverage:
    """The ``Coverage`` of ``module``'s submodules (names prefixed with ``prefix`` + ".")."""
    quantized, high = {}, {}
    for name, m in module.named_modules():
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        if is_quantized_linear(m):
            quantized[full] = m.in_features * m.out_features
            continue
        if isinstance(m, QuantizedExperts):  # fused MoE experts: E * (2I*H + H*I) weight elements
            quantized[full] = m.weight_elements
            continue
        n = sum(p.numel() for p in m.parameters(recurse=False) if p.is_floating_point() and p.dim() >= 2)
        if n:
            high[full] = n
    return Coverage(quantized, high)


__all__ = ["Coverage", "weight_coverage"]
