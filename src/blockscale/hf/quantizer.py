"""BlockscaleHfQuantizer: transformers' ``HfQuantizer`` for ``BlockscaleConfig``, following the mechanism of
transformers' own on-the-fly quantizers (``FineGrainedFP8HfQuantizer``, ``FPQuantHfQuantizer``): before the
weights load, the model (on the meta device) is planned; ``param_needs_quantization`` selects the tensors of
the modules PTQ replaces, and transformers hands each of them, as it reads it, to the conversion op of
``get_quantize_ops`` (``QuantizeOnLoad``), which gives it to the ``layer_loader.LayerLoader``: a decoder layer is
quantized as soon as it is complete. Loading is sequential for on-the-fly quantizers (transformers reads each
tensor only when its conversion runs), so at most one decoder layer is ever held in full precision.

After loading, ``model.save_pretrained`` is replaced on the instance by ``save.save_quantized``, which writes
blockscale's compressed-tensors export (``bs.export_checkpoint``): transformers' own save path writes the state
dict under the config's quant method and has no public hook for another checkpoint layout (see save.py).
"""
from __future__ import annotations

import types

from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer

from ..errors import UsageError
from .config import QUANT_METHOD, BlockscaleConfig
from .layer_loader import LayerLoader
from .save import save_quantized


class QuantizeOnLoad(ConversionOps):
    """transformers' conversion op for the tensors the quantizer selected: each one goes to the loader, which
    sets it in the model (and quantizes a complete layer); nothing is returned for transformers to set."""

    def __init__(self, loader: LayerLoader):
        self.loader = loader

    def convert(self, input_dict: dict, source_patterns=None, target_patterns=None, missing_keys=None, **kwargs):
        left = {}
        for name, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            if not self.loader.wants(name):
                left[name] = value
                continue
            self.loader.put(name, tensor)
            if missing_keys is not None:
                missing_keys.discard(name)
        return left


class BlockscaleHfQuantizer(HfQuantizer):
    """Quantization on load with a ``BlockscaleConfig`` (RTN, no calibration); not for checkpoints that are
    quantized already (load those without a quantization_config, or with ``bs.load``)."""

    requires_calibration = False
    quantization_config: BlockscaleConfig

    def __init__(self, quantization_config: BlockscaleConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.loader = None
        self.report = None  # the PTQ report (bs.PTQReport) once loaded

    def validate_environment(self, *args, device_map=None, **kwargs):
        if not isinstance(self.quantization_config, BlockscaleConfig):
            raise UsageError(f"quant_method {QUANT_METHOD!r} needs a BlockscaleConfig, got "
                             f"{type(self.quantization_config).__name__}")
        if self.pre_quantized:
            raise UsageError(f"this checkpoint's config.json says quant_method {QUANT_METHOD!r}, but blockscale "
                             "writes quantized checkpoints as compressed-tensors or ModelOpt: load its export "
                             "directory, or a full-precision checkpoint with quantization_config=BlockscaleConfig(...)")
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        if "disk" in places:
            raise UsageError("device_map offloads to 'disk', which quantization on load does not support: load "
                             "onto devices (each decoder layer is quantized where it is loaded)")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return self.loader is not None and self.loader.wants(param_name)

    def _process_model_before_weight_loading(self, model, **kwargs):
        self.loader = LayerLoader(model, self.quantization_config.ptq_config)
        return model

    def get_quantize_ops(self):
        return QuantizeOnLoad(self.loader)

    def _process_model_after_weight_loading(self, model, **kwargs):
        self.report = self.loader.finish()
        self.loader = None  # (the full-precision modules it planned are released; the report stays)
        model.save_pretrained = types.MethodType(save_quantized, model)
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


__all__ = ["BlockscaleHfQuantizer", "QuantizeOnLoad"]
