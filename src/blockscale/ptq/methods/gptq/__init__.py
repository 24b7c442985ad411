"""GPTQ: the NVFP4 algorithm (``gptq_quantize``), the fixed-grid FP8 / MX one (``gptq_fixed_grid``), their
options, and the PTQ method."""
from .algorithm import gptq_quantize
from .fixed_grid import gptq_fixed_grid
from .method import GPTQ
from .options import BLOCK, FOUR_OVER_SIX_MODES, GPTQOptions
from .sequential import check_true_sequential, dataflow_stages

__all__ = ["BLOCK", "FOUR_OVER_SIX_MODES", "GPTQ", "GPTQOptions", "check_true_sequential", "dataflow_stages",
           "gptq_fixed_grid", "gptq_quantize"]
