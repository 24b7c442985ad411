"""Evaluation: perplexity over a token stream."""
from .perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
