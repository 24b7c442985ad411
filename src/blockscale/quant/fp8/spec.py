"""The FP8 spec: E4M3 / E5M2 elements with FP32 scales per tensor, channel, token or block."""
from __future__ import annotations

from dataclasses import dataclass

from ...formats.constants import element_format
from ..spec_checks import check_choice, check_rounding

FP8_ELEMENTS = ("e4m3", "e5m2")
FP8_GRANULARITIES = ("tensor", "channel", "token", "block")
FP8_BLOCK_SHAPES = ((128, 128), (1, 128))
#: max_elem: the scale maps a group's amax to it (s = amax / max_elem)
FP8_MAX = {element: element_format(element).max for element in FP8_ELEMENTS}


@dataclass(frozen=True)
class FP8:
    """FP8: E4M3 / E5M2 codes with one FP32 dequantization scale ``s = amax / max_elem`` per group.

    element: "e4m3" (max 448) or "e5m2" (max 57344).
    granularity: the group one scale covers:
      "tensor"  the whole tensor (scales shape []);
      "channel" one row along the last dim, e.g. an output row of a weight [N, K] (scales lead + (1,));
      "token"   the same per-row computation, named for activations (dynamic, per input row);
      "block"   ``block_shape`` tiles: (128, 128) over the last two dims (weights; scales
                lead + (ceil(N/128), ceil(K/128))) or (1, 128) groups along the last dim
                (activations; scales lead + (ceil(K/128),)): the DeepSeek-V3 layout.
    block_shape: (128, 128) or (1, 128); only with granularity "block" (otherwise it stays (128, 128)).
      A YAML list is accepted and stored as a tuple.
    rounding / sr_mode: element rounding ("nearest" = RNE, or "stochastic"); codes always saturate.
    """

    element: str = "e4m3"
    granularity: str = "tensor"
    block_shape: tuple = (128, 128)
    rounding: str = "nearest"
    sr_mode: str = "hardware"

    def __post_init__(self):
        check_choice("element", self.element, FP8_ELEMENTS)
        check_choice("granularity", self.granularity, FP8_GRANULARITIES)
        shape = self.block_shape
        if isinstance(shape, list):  # from YAML
            shape = tuple(shape)
            object.__setattr__(self, "block_shape", shape)
        if not isinstance(shape, tuple) or not all(type(d) is int for d in shape):
            raise ValueError(f"block_shape={self.block_shape!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, FP8_BLOCK_SHAPES))}")
        check_choice("block_shape", shape, FP8_BLOCK_SHAPES)
        if self.granularity != "block" and shape != (128, 128):
            raise ValueError(f"block_shape={shape!r} applies to granularity='block' only "
                             f"(granularity={self.granularity!r}); leave it at (128, 128)")
        check_rounding(self.rounding, self.sr_mode)

    @property
    def max_elem(self) -> float:
        """448 (E4M3) or 57344 (E5M2)."""
        return FP8_MAX[self.element]

    @property
    def group_shape(self) -> tuple | None:
        """(rows, cols) of one scale's group over the last two dims: None per tensor, (1, 0) per row
        (0 = the whole last dim), else ``block_shape``."""
        if self.granularity == "tensor":
            return None
        if self.granularity in ("channel", "token"):
            return (1, 0)
        return self.block_shape


__all__ = ["FP8", "FP8_BLOCK_SHAPES", "FP8_ELEMENTS", "FP8_GRANULARITIES", "FP8_MAX"]
