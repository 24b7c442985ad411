"""Per-input-channel smoothing before NVFP4 PTQ: the groups of a decoder layer where scales fold
(``groups``), folding them in place (``fold``) and the per-layer loop AWQ and SmoothQuant share
(``layer``). The scale choices themselves are the methods' (``ptq.methods.awq`` / ``.smoothquant``)."""
from .fold import check_alpha, check_scales, check_weights, fold_smoothing
from .groups import FLOAT_DTYPES, SmoothingGroup, check_norm_absorbs_scales, find_smoothing_groups
from .layer import check_folded, check_smoothable, smooth_layer

__all__ = ["FLOAT_DTYPES", "SmoothingGroup", "check_alpha", "check_folded", "check_norm_absorbs_scales",
           "check_scales", "check_smoothable", "check_weights", "find_smoothing_groups", "fold_smoothing",
           "smooth_layer"]
