"""Per-input-channel smoothing before NVFP4 PTQ: the groups of a decoder layer where scales fold
(``families``: the per-family table of groups and its lookup; ``groups``: ``SmoothingGroup``; ``moe``: MoE
layers with routers, fused or per-expert experts and shared experts, and MLA attention; ``slices``:
``WeightSlice``, rows of a weight as producer or consumer), folding them in place (``fold``) and the
per-layer loop AWQ and SmoothQuant share (``layer``). The scale choices themselves are the methods'
(``ptq.methods.awq`` / ``.smoothquant``)."""
from .families import (FOLDS, SMOOTHING_FAMILIES, GroupRule, SmoothingFamily, find_smoothing_groups,
                       layer_smoothing_groups, smoothing_family)
from .fold import check_alpha, check_scales, check_weights, fold_smoothing
from .groups import FLOAT_DTYPES, SmoothingGroup, check_norm_absorbs_scales
from .layer import GroupPart, check_folded, check_smoothable, moe_group_parts, smooth_layer
from .moe import Consumer, MoESmoothingGroup, find_moe_smoothing_groups, fold_moe_smoothing
from .slices import WeightSlice

__all__ = ["Consumer", "FLOAT_DTYPES", "FOLDS", "GroupPart", "GroupRule", "MoESmoothingGroup", "SMOOTHING_FAMILIES",
           "SmoothingFamily", "SmoothingGroup", "WeightSlice", "check_alpha", "check_folded",
           "check_norm_absorbs_scales", "check_scales", "check_smoothable", "check_weights",
           "find_moe_smoothing_groups", "find_smoothing_groups", "fold_moe_smoothing", "fold_smoothing",
           "layer_smoothing_groups", "moe_group_parts", "smooth_layer", "smoothing_family"]
