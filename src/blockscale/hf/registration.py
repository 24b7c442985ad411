"""Registration with transformers' public quantizer registry (``transformers.quantizers.register_quantization_config``
and ``register_quantizer``) under the quant method ``"blockscale"``: ``from_pretrained(...,
quantization_config=BlockscaleConfig(...))`` then finds ``BlockscaleHfQuantizer``. Importing ``blockscale.hf``
registers them once (``register``); a second call finds them registered and does nothing."""
from __future__ import annotations

from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from ..errors import UsageError
from .config import QUANT_METHOD, BlockscaleConfig
from .quantizer import BlockscaleHfQuantizer


def register() -> None:
    """Register ``BlockscaleConfig`` and ``BlockscaleHfQuantizer`` as quant method ``"blockscale"`` (UsageError
    when another class holds that name)."""
    for table, cls, add in ((AUTO_QUANTIZATION_CONFIG_MAPPING, BlockscaleConfig, register_quantization_config),
                            (AUTO_QUANTIZER_MAPPING, BlockscaleHfQuantizer, register_quantizer)):
        held = table.get(QUANT_METHOD)
        if held is None:
            add(QUANT_METHOD)(cls)
        elif held is not cls:
            raise UsageError(f"transformers already has a quantizer registered as {QUANT_METHOD!r} "
                             f"({held.__module__}.{held.__name__})")


__all__ = ["register"]
