"""Evaluation: the one next-token loss evaluation, and perplexity over a token stream (windows of it)."""
from .next_token import WEIGHTINGS, model_device, next_token_loss, output_logits
from .perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "WEIGHTINGS", "model_device", "next_token_loss", "output_logits", "perplexity"]
