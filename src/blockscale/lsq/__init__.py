"""Learned step size (LSQ) training of NVFP4 block scales."""
from .quantizer import LSQ_INITS, LSQ_MODES, NVFP4ScaleLearner, lsq_fake_quantize

__all__ = ["NVFP4ScaleLearner", "lsq_fake_quantize", "LSQ_MODES", "LSQ_INITS"]
