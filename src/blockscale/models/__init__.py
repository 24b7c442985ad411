"""Models: a small Llama-style decoder and loaders for real pretrained checkpoints."""
from .llama import PRESETS, Llama, LlamaConfig, RMSNorm, apply_rope, rope_tables
from .stories260k import Tok512, load_stories260k, load_tokenizer

__all__ = ["PRESETS", "Llama", "LlamaConfig", "RMSNorm", "Tok512", "apply_rope", "load_stories260k",
           "load_tokenizer", "rope_tables"]
