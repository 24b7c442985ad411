"""blockscale: block-scaled low-precision formats (NVFP4, MXFP8/MXFP4, S2F6) for PyTorch.

    import blockscale as bs
    q = bs.quantize(x, bs.NVFP4(scale_rule="4over6"))
    x_hat = q.dequantize()
"""
from .quant import (
    MX,
    NVFP4,
    S2F6,
    TE_SIGNS_16,
    QuantizedTensor,
    dequantize,
    fake_quantize,
    get_backend,
    hadamard,
    hadamard_matrix,
    inverse_hadamard,
    quantize,
    random_signs,
    set_backend,
    swizzle_scales,
    unswizzle_scales,
    use_backend,
)
from .recipes import LinearRecipe, Recipe, get_recipe, list_recipes, load_recipe_file, save_recipe  # noqa: E402
from .nn import ConversionReport, QuantizedLinear, convert, unconvert  # noqa: E402
from .models import PRESETS as MODEL_PRESETS, Llama, LlamaConfig, load_stories260k, load_tokenizer  # noqa: E402
from .eval import PerplexityResult, perplexity  # noqa: E402
from .paths import data_root  # noqa: E402
from .nn import NVFP4Linear  # noqa: E402
from .ptq import PTQConfig, PTQReport, quantize_model  # noqa: E402
from .export import CheckpointError, checkpoint_format, export_checkpoint, load_checkpoint  # noqa: E402

load = load_checkpoint

__version__ = "0.1.0"

__all__ = [
    "MX", "NVFP4", "S2F6", "QuantizedTensor", "TE_SIGNS_16", "dequantize", "fake_quantize", "get_backend",
    "hadamard", "hadamard_matrix", "inverse_hadamard", "quantize", "random_signs", "set_backend",
    "swizzle_scales", "unswizzle_scales", "use_backend",
    "LinearRecipe", "Recipe", "get_recipe", "list_recipes", "load_recipe_file", "save_recipe",
    "ConversionReport", "QuantizedLinear", "convert", "unconvert",
    "MODEL_PRESETS", "Llama", "LlamaConfig", "load_stories260k", "load_tokenizer", "PerplexityResult", "perplexity",
    "data_root", "NVFP4Linear", "PTQConfig", "PTQReport", "quantize_model", "CheckpointError", "checkpoint_format",
    "export_checkpoint", "load", "load_checkpoint",
]
