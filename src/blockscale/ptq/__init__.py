"""Post-training quantization to NVFP4: layer-by-layer calibration, methods behind one protocol
(``protocol.PTQMethod``: collect statistics -> transform the layer -> quantize weights), registered by
name in ``methods.METHODS``: RTN, AWQ, SmoothQuant, GPTQ, AutoRound."""
from .config import ACTIVATIONS, WEIGHT_SCALE_RULES, PTQConfig
from .methods import (AWQ, GPTQ, METHODS, RTN, AutoRound, AutoRoundOptions, AWQOptions, GPTQOptions, RTNOptions,
                      SmoothQuant, SmoothQuantOptions, register_method)
from .methods.awq import AWQResult, awq_search
from .methods.gptq import gptq_fixed_grid, gptq_quantize
from .methods.smoothquant import smoothquant_scales
from .oneshot import OneshotOptions, OneshotResult, PerplexityEval, oneshot
from .options import OptionError, option
from .protocol import LayerContext, PTQMethod, QuantizedWeight, SolvedMethod, StartWeight
from .quantize_model import LinearReport, PTQReport, quantize_model
from .smoothing import SmoothingGroup, find_smoothing_groups, fold_smoothing
from .statistics import HessianAccumulator, InputStatistics, StatisticsRequest
from .stream_options import StreamingOptions
from .stream_quantizer import StreamingQuantizer

__all__ = ["ACTIVATIONS", "AWQ", "AWQOptions", "AutoRound", "AutoRoundOptions", "AWQResult", "GPTQ", "GPTQOptions", "HessianAccumulator",
           "InputStatistics", "LayerContext", "LinearReport", "METHODS", "OneshotOptions", "OneshotResult",
           "OptionError", "PTQConfig", "PTQMethod", "PTQReport", "PerplexityEval", "QuantizedWeight", "RTN", "SolvedMethod", "StartWeight",
           "RTNOptions", "SmoothQuant", "SmoothQuantOptions", "SmoothingGroup", "StatisticsRequest", "StreamingOptions",
           "StreamingQuantizer", "WEIGHT_SCALE_RULES", "awq_search", "find_smoothing_groups", "fold_smoothing",
           "gptq_fixed_grid", "gptq_quantize", "oneshot", "option", "quantize_model", "register_method",
           "smoothquant_scales"]
