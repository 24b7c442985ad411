"""Transforms around the formats: Hadamard rotations, the cuBLAS scale swizzle, the MoE wire codecs and
NVFP4 -> MX requantization of the transpose.

Import the modules themselves (``quant.transforms.hadamard`` etc.): this ``__init__`` imports nothing,
so ``quant.tensor`` can use ``swizzle`` while ``wire`` uses ``tensor`` without an import circle.
"""
