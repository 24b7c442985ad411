"""Post-training quantization: layer-by-layer calibration, RTN / AWQ / SmoothQuant / GPTQ to NVFP4."""
from .config import ACTIVATIONS, METHODS, WEIGHT_SCALE_RULES, PTQConfig
from .gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from .quantize_model import LinearReport, PTQReport, quantize_model
from .smoothing import AWQResult, SmoothingGroup, awq_search, find_smoothing_groups, fold_smoothing, smoothquant_scales

__all__ = ["ACTIVATIONS", "METHODS", "WEIGHT_SCALE_RULES", "AWQResult", "GPTQConfig", "HessianAccumulator",
           "LinearReport", "PTQConfig", "PTQReport", "SmoothingGroup", "awq_search", "find_smoothing_groups",
           "fold_smoothing", "gptq_quantize", "quantize_model", "smoothquant_scales"]
