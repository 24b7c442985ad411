"""blockscale: block-scaled low-precision formats (NVFP4, MXFP8/MXFP4, FP8, S2F6) for PyTorch.

    import blockscale as bs
    q = bs.quantize(x, bs.NVFP4(scale_rule="4over6"))
    x_hat = q.dequantize()

What a user needs, grouped as in ``__all__`` below; the sub-packages (``blockscale.quant``, ``.recipes``,
``.nn``, ``.models``, ``.data``, ``.train``, ``.ptq``, ``.lsq``, ``.export``, ``.eval``, ``.hf``) hold the rest.
"""
from .version import __version__
from .errors import BlockscaleError, CheckpointError, DataError, QuantizationError, UsageError
from .quant import (FP8, MX, NVFP4, S2F6, TE_SIGNS_16, Format, FormatSpec, QuantizedTensor, dequantize, fake_quantize,
                    format_named, format_of, get_backend, hadamard, hadamard_matrix, inverse_hadamard,
                    quantize, random_signs, set_backend, swizzle_scales, unswizzle_scales, use_backend)
from .recipes import (KVCacheScheme, LinearRecipe, PTQRecipe, PTQRule, Recipe, Scheme, get_ptq_recipe, get_recipe,
                      list_ptq_recipes, list_recipes, load_ptq_recipe_file, load_recipe_file, save_ptq_recipe, save_recipe)
from .nn import ConversionReport, FP8Linear, MXLinear, NVFP4Linear, QuantizedLinear, convert, unconvert
from .data import data_root
from .models import PRESETS as MODEL_PRESETS, Llama, LlamaConfig, load_stories260k, load_tokenizer
from .eval import PerplexityResult, perplexity
from .train import TrainConfig, TrainResult
from .ptq import AutoRoundOptions, AWQOptions, GPTQOptions, PTQConfig, PTQReport, RTNOptions, SmoothQuantOptions, quantize_model
from .lsq import DistillConfig, distill
from .export import checkpoint_format, export_checkpoint, load_checkpoint

load = load_checkpoint


def __getattr__(name: str):
    """``bs.BlockscaleConfig`` (the transformers integration, ``blockscale.hf``) is imported on first use, so
    ``import blockscale`` does not import transformers."""
    if name == "BlockscaleConfig":
        try:
            from .hf import BlockscaleConfig
        except ModuleNotFoundError as exc:
            if exc.name != "transformers":
                raise
            raise ImportError("bs.BlockscaleConfig needs transformers >= 5: pip install 'transformers>=5'") from exc
        return BlockscaleConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # formats and quantizing a tensor
    "FP8", "MX", "NVFP4", "S2F6", "FormatSpec", "QuantizedTensor", "quantize", "dequantize", "fake_quantize",
    "Format", "format_named", "format_of",  # (blockscale.quant.formats() lists them; bs.formats is the codecs package)
    "get_backend", "set_backend", "use_backend",
    "TE_SIGNS_16", "hadamard", "hadamard_matrix", "inverse_hadamard", "random_signs",
    "swizzle_scales", "unswizzle_scales",
    # recipes and quantized layers (training)
    "LinearRecipe", "Recipe", "get_recipe", "list_recipes", "load_recipe_file", "save_recipe",
    "ConversionReport", "QuantizedLinear", "convert", "unconvert",
    # PTQ recipes (per-module schemes, FP8 KV cache) and the quantized inference layers
    "PTQRecipe", "PTQRule", "Scheme", "KVCacheScheme", "get_ptq_recipe", "list_ptq_recipes", "load_ptq_recipe_file",
    "save_ptq_recipe", "NVFP4Linear", "FP8Linear", "MXLinear",
    # models and data
    "MODEL_PRESETS", "Llama", "LlamaConfig", "load_stories260k", "load_tokenizer", "data_root",
    # workflows
    "TrainConfig", "TrainResult",  # blockscale.train.train runs it (bs.train is the package)
    "PTQConfig", "PTQReport", "quantize_model", "RTNOptions", "AWQOptions", "SmoothQuantOptions", "GPTQOptions", "AutoRoundOptions",
    "DistillConfig", "distill",
    "export_checkpoint", "load_checkpoint", "load", "checkpoint_format",
    "BlockscaleConfig",  # transformers' from_pretrained(..., quantization_config=...): quantize on load (lazy)
    "PerplexityResult", "perplexity",
    # errors
    "BlockscaleError", "CheckpointError", "DataError", "QuantizationError", "UsageError",
]
