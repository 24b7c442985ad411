"""The transformers integration: ``BlockscaleConfig``, a ``quantization_config`` with which
``AutoModelForCausalLM.from_pretrained(name_or_dir, quantization_config=BlockscaleConfig(recipe=...,
scale_rule=...))`` quantizes the model with a blockscale PTQ recipe as it loads it, one decoder layer at a time
(RTN, no calibration; equal to ``bs.quantize_model`` with ``config.ptq_config`` bit for bit), and whose
``save_pretrained`` writes blockscale's compressed-tensors export. Importing this package imports transformers
and registers the quant method ``"blockscale"`` (``registration``); ``import blockscale`` does not import it
(``bs.BlockscaleConfig`` does, on first use). Needs transformers >= 5 (its weight-conversion loading engine,
``transformers.core_model_loading``; tested with 5.25). docs/transformers.md."""
import transformers

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"blockscale's transformers integration (BlockscaleConfig) needs transformers >= 5, found "
                      f"{transformers.__version__}: pip install -U 'transformers>=5'")

from .config import QUANT_METHOD, BlockscaleConfig
from .layer_loader import LayerLoader
from .quantizer import BlockscaleHfQuantizer, QuantizeOnLoad
from .registration import register
from .save import save_quantized

register()

__all__ = ["BlockscaleConfig", "BlockscaleHfQuantizer", "LayerLoader", "QUANT_METHOD", "QuantizeOnLoad",
           "register", "save_quantized"]
