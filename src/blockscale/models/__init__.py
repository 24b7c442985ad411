"""Models: a small Llama-style decoder, loaders for real pretrained checkpoints, and our MoE Llama saved
as a transformers Mixtral (``save_hf_mixtral``)."""
from .hf_moe_export import save_hf_mixtral, to_hf_mixtral
from .llama import PRESETS, Llama, LlamaConfig, RMSNorm, apply_rope, rope_tables
from .stories260k import Tok512, load_stories260k, load_tokenizer

__all__ = ["PRESETS", "Llama", "LlamaConfig", "RMSNorm", "Tok512", "apply_rope", "load_stories260k",
           "load_tokenizer", "rope_tables", "save_hf_mixtral", "to_hf_mixtral"]
