"""The PTQ workflow end to end: load a model, calibrate and quantize it, evaluate, export.

Used by ``blockscale quantize`` / ``blockscale eval ppl`` / ``blockscale demo`` and the results script.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..errors import DataError, UsageError
from ..eval.perplexity import perplexity
from ..models.hf import (LoadedModel, is_blockscale_checkpoint, load_model, open_tokenizer, source_model,
                         stories260k_tokenizer)
from ..data.text_sources import calibration_batches, evaluation_tokens
from .config import PTQConfig
from .quantize_model import PTQReport, quantize_model

BOS_MODES = ("none", "stream", "window")


def open_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, device="cpu",
               verify: bool = True) -> LoadedModel:
    """``models.hf.load_model``, plus NVFP4 checkpoints written by ``export_checkpoint`` (with their
    tokenizer: the saved transformers one, or stories260K's tok512 when the metadata names it).
    ``verify``: check an NVFP4 checkpoint's recorded SHA-256 digests (``load_checkpoint(verify=)``)."""
    from pathlib import Path

    path = Path(name_or_path)
    if not (path.is_dir() and is_blockscale_checkpoint(path)):
        return load_model(name_or_path, dtype=dtype, device=device)
    from ..export import load_checkpoint

    model = load_checkpoint(path, dtype=dtype, device=device, verify=verify)
    tok = None
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        tok = open_tokenizer(path)
    elif source_model(path) == "stories260k":  # its tok512 tokenizer is not a transformers one
        tok = stories260k_tokenizer()
    return LoadedModel(model, tok, str(name_or_path))


@dataclass(frozen=True)
class TextDefaults:
    calib: str
    eval: str
    bos: str  # how evaluation windows see BOS: "none" | "stream" (one BOS at the start) | "window"
    calib_bos: bool
    ctx: int


def default_texts(model_name: str) -> TextDefaults:
    """Calibration / evaluation text a model is usually measured on (all offline, built in); for an
    exported checkpoint, those of the model it was made from."""
    from pathlib import Path

    if Path(model_name).is_dir():
        model_name = source_model(Path(model_name)) or str(model_name)
    if str(model_name).lower() == "stories260k":
        # disjoint parts of the TinyStories head: calibrate on the last 20%, the ppl on all of it is
        # the known 5.05 (README of the data folder); use "tinystories#0:0.8" for a held-out ppl
        return TextDefaults(calib="tinystories#0.8:1", eval="tinystories", bos="stream", calib_bos=True, ctx=512)
    return TextDefaults(calib="c4", eval="wikitext2", bos="none", calib_bos=False, ctx=1024)


@dataclass
class PPLRecord:
    source: str
    ctx: int
    bos: str
    tokens_evaluated: int
    loss: float
    ppl: float
    seconds: float


def evaluate_ppl(model, tokenizer, source: str, ctx: int, bos: str = "none", max_tokens: Optional[int] = None,
                 batch_size: int = 4, progress: bool = False) -> PPLRecord:
    """Perplexity of ``model`` on ``source`` (non-overlapping ``ctx``-token windows, every token scored).
    bos: "none" (no BOS), "stream" (one BOS before the whole stream), "window" (BOS opens every window).
    progress: a progress bar, shown only when stderr is a terminal. A loss that is not finite (NaN / inf
    logits: a corrupt model) is a DataError, never a "ppl nan" result."""
    if bos not in BOS_MODES:
        raise UsageError(f"bos={bos!r}; allowed values: {', '.join(BOS_MODES)}")
    if tokenizer is None:
        raise UsageError("this model has no tokenizer to encode evaluation text with (save one next to its weights)")
    if bos == "window" and tokenizer.bos_id is None:
        raise UsageError("bos 'window' (BOS opening every window) but the tokenizer has no BOS token")
    t0 = time.time()
    ids = evaluation_tokens(tokenizer, source, bos_at_start=(bos == "stream"), max_tokens=max_tokens)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if ids.numel() < 2:
        raise DataError(f"evaluation text {source} has {ids.numel()} token(s): nothing to score")
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise DataError(f"evaluation text {source} encodes to token id {int(ids.max())}, outside the model's "
                        f"vocabulary of {vocab}: the tokenizer does not belong to this model")
    r = perplexity(model, ids, ctx, bos_id=tokenizer.bos_id if bos == "window" else None, batch_size=batch_size,
                   progress=progress and sys.stderr.isatty())
    if not math.isfinite(r.loss):
        raise DataError(f"the evaluation loss on {source} is {r.loss} (not finite): the model produces NaN or inf "
                        "logits, so its weights or config are corrupt")
    return PPLRecord(source + (f" (first {max_tokens} tokens)" if max_tokens else ""), ctx, bos, r.tokens_evaluated,
                     r.loss, r.ppl, time.time() - t0)


def calibrate_and_quantize(model, tokenizer, config: PTQConfig, calib: str, calib_bos: bool = False, *, device=None,
                           progress: bool = True, latent_weights: Optional[dict] = None) -> PTQReport:
    """Draw calibration windows from ``calib`` (when the method needs them) and quantize ``model`` in place
    (``latent_weights``: see ``quantize_model``)."""
    batches = None
    if config.needs_calibration:
        if tokenizer is None:
            what = (f"recipe={config.recipe.name!r}" if config.recipe is not None
                    else f"activations={config.activations!r}")
            raise ValueError(f"method={config.method!r} / {what} calibrates on text, "
                             "but this model has no tokenizer (save one next to the weights)")
        batches = calibration_batches(tokenizer, calib, config.n_samples, config.seq_len, seed=config.seed,
                                      bos=calib_bos)
    report = quantize_model(model, config, batches, device=device, progress=progress, latent_weights=latent_weights)
    report.config["calibration_source"] = calib if batches is not None else None
    return report


def quantized_copy(model, tokenizer, config: PTQConfig, calib: str, calib_bos: bool = False, **kw):
    """A quantized deep copy of ``model`` (the original stays full precision) and its report."""
    m = copy.deepcopy(model)
    return m, calibrate_and_quantize(m, tokenizer, config, calib, calib_bos, **kw)


def record_dict(rec) -> dict:
    return asdict(rec)


__all__ = ["BOS_MODES", "open_model", "PPLRecord", "TextDefaults", "calibrate_and_quantize", "default_texts", "evaluate_ppl",
           "quantized_copy"]
