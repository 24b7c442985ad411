"""``oneshot``: post-training quantization as one library call (what ``blockscale quantize`` runs).

In order: check that ``format`` can store every scheme of the configuration (``export_check``: before any
work), calibrate and quantize the loaded model in place (``pipeline.calibrate_and_quantize``; under
torchrun every rank, data-parallel: ``ptq.distributed``), then on rank 0 alone (or the only process)
evaluate perplexity (optional) and export the checkpoint with a summary in config.json
(``quantization_config.blockscale``) and the per-layer report in ``ptq_report.json``. The other ranks
return after quantizing, nothing written (``OneshotResult.main_rank`` False).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..export import export_checkpoint
from ..errors import UsageError
from ..export.common import jsonable
from ..export.registry import format_named
from ..train.distributed import env_world
from .config import PTQConfig
from .export_check import check_recipe_exportable
from . import pipeline
from .pipeline import PPLRecord, evaluate_ppl, record_dict
from .quantize_model import PTQReport


@dataclass(frozen=True)
class PerplexityEval:
    """Perplexity after quantizing (``pipeline.evaluate_ppl``): text ``source`` in non-overlapping
    ``ctx``-token windows; ``bos`` "none" | "stream" | "window"; ``max_tokens``: the first N tokens only."""

    source: str
    ctx: int
    bos: str = "none"
    max_tokens: Optional[int] = None


@dataclass(frozen=True)
class OneshotOptions:
    """The keyword arguments of ``oneshot``, grouped. ``calib_bos``: every calibration window starts with BOS;
    ``evaluation``: a perplexity evaluation after quantizing (None: none); ``model_name``: recorded as
    ``"model"`` in the summary and the report (``models.hf.source_model`` reads it back); ``source`` /
    ``max_shard_size`` / ``overwrite``: as ``export_checkpoint``; ``device``: where each layer is calibrated
    (default cpu); ``progress``: progress bars (evaluation's only on a terminal); ``wrap_quantize``: called
    with the quantize step (no arguments, returns the ``PTQReport``) and returns its report, e.g. to handle
    the warnings it emits; ``log``: receives the perplexity line (``perplexity P (loss L, N tokens of
    SOURCE)``) once evaluated, before the export."""

    calib_bos: bool = False
    evaluation: Optional[PerplexityEval] = None
    model_name: Optional[str] = None
    source: Any = None
    device: Any = None
    max_shard_size: Union[int, str] = "2GB"
    overwrite: bool = False
    progress: bool = True
    wrap_quantize: Optional[Callable[[Callable[[], PTQReport]], PTQReport]] = None
    log: Optional[Callable[[str], None]] = None


@dataclass(frozen=True)
class OneshotResult:
    """report: the PTQ report (every rank); perplexity: the evaluation (None without one); path: the
    checkpoint directory written; main_rank False: a torchrun rank other than 0 (nothing evaluated or
    written)."""

    report: PTQReport
    perplexity: Optional[PPLRecord] = None
    path: Optional[Path] = None
    main_rank: bool = True


def oneshot(model, tokenizer, config: PTQConfig, calibration: str, out: Union[str, Path],
            format: str = "compressed-tensors", **options) -> OneshotResult:
    """Quantize ``model`` (a transformers causal LM, in place) with ``config``, calibrating on
    ``calibration`` text (a ``data.text_sources`` name, file or ``hf:`` source; read only when the
    configuration calibrates) encoded by ``tokenizer`` (a ``models.hf`` tokenizer or None), optionally
    evaluate it, and export it to ``out`` in ``format`` (as the module docstring says). ``options``: the
    fields of ``OneshotOptions`` (an unknown one is a TypeError). A format that cannot store a scheme of
    ``config`` is a UsageError before anything runs."""
    opt = OneshotOptions(**options)
    check_recipe_exportable(config.ptq_recipe, format)
    plan = config.rotation_plan
    if plan.online and format_named(format).transforms is None:
        raise UsageError(f"rotate={config.rotate!r} rotates Linear inputs or keys online, which {format_named(format).name} "
                         "checkpoints cannot hold: export compressed-tensors (transform_config), or use fused "
                         "rotations only (rotate='r1r2')")

    def quantize() -> PTQReport:  # pipeline.calibrate_and_quantize looked up per call: tests replace it
        return pipeline.calibrate_and_quantize(model, tokenizer, config, calibration, opt.calib_bos,
                                               device=opt.device, progress=opt.progress)

    report = quantize() if opt.wrap_quantize is None else opt.wrap_quantize(quantize)
    if opt.log is not None and env_world()[0] == 0:
        for line in report.rotation:  # what --rotate did
            opt.log(line)
    if env_world()[0] != 0:  # torchrun: rank 0 alone evaluates and writes
        return OneshotResult(report, main_rank=False)
    meta = {"model": opt.model_name, "ptq": report.to_dict()}
    rec = None
    if opt.evaluation is not None:
        ev = opt.evaluation
        rec = evaluate_ppl(model, tokenizer, ev.source, ev.ctx, ev.bos, ev.max_tokens, progress=opt.progress)
        meta["perplexity"] = record_dict(rec)
        if opt.log is not None:
            opt.log(f"perplexity {rec.ppl:.4f} (loss {rec.loss:.4f}, {rec.tokens_evaluated} tokens of {rec.source})")
    # config.json (read by serving engines) gets a summary; the per-layer report goes to ptq_report.json
    summary = {"model": opt.model_name, "method": config.label, "config": report.config, "seconds": report.seconds,
               "calibration_tokens": report.calibration_tokens, "perplexity": meta.get("perplexity")}
    path = export_checkpoint(model, Path(out), format, tokenizer=tokenizer.hf if tokenizer else None,
                             max_shard_size=opt.max_shard_size, metadata=jsonable(summary),
                             overwrite=opt.overwrite, source=opt.source,
                             extra_files={"ptq_report.json": jsonable(meta)})
    return OneshotResult(report, rec, path)


__all__ = ["OneshotOptions", "OneshotResult", "PerplexityEval", "oneshot"]
