"""The error classes blockscale raises for bad input, one per failure class (a leaf module: every
layer may import it). The command line prints any of them as one line ``blockscale <cmd>: error: ...``;
``UsageError`` exits with code 2 (a bad flag or argument), every other ``BlockscaleError`` with 1.

All are ``ValueError`` subclasses, so code that caught ``ValueError`` before keeps working.
"""
from __future__ import annotations


class BlockscaleError(Exception):
    """Base class of blockscale's own errors."""


class UsageError(BlockscaleError, ValueError):
    """A bad argument or command-line flag value (names the argument and the allowed values)."""


class CheckpointError(BlockscaleError, ValueError):
    """An NVFP4 checkpoint directory that cannot be loaded: missing / unexpected / mis-shaped tensors,
    corrupt files, invalid values, inconsistent configs. The message names the file, key or tensor."""


class DataError(BlockscaleError, ValueError):
    """Calibration / evaluation / training data that cannot be used: empty, token ids outside the
    vocabulary, non-finite values in activations or results."""


class QuantizationError(BlockscaleError, ValueError):
    """Post-training quantization cannot proceed for a named module (non-finite weights, an
    unsupported layer, a model left mostly in high precision)."""


__all__ = ["BlockscaleError", "CheckpointError", "DataError", "QuantizationError", "UsageError"]
