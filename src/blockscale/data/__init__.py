"""Data: where the shared data lives (``paths``), text sources for calibration and evaluation
(``text_sources``), and the one tokenizer interface (``tokenizer``)."""
from .paths import allowed_roots, data_root, resolves_inside
from .text_sources import BUILTIN_TEXTS, calibration_batches, check_text_source, evaluation_tokens, load_text
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = ["BUILTIN_TEXTS", "ByteTokenizer", "Tokenizer", "allowed_roots", "calibration_batches", "check_text_source",
           "data_root", "evaluation_tokens", "load_text", "resolves_inside"]
