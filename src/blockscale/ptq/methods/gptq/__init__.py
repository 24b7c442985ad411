"""GPTQ for NVFP4: the algorithm (``gptq_quantize``), its options, and the PTQ method."""
from .algorithm import gptq_quantize
from .method import GPTQ
from .options import BLOCK, FOUR_OVER_SIX_MODES, GPTQOptions

__all__ = ["BLOCK", "FOUR_OVER_SIX_MODES", "GPTQ", "GPTQOptions", "gptq_quantize"]
