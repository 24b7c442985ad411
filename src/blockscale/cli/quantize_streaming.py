"""``blockscale quantize MODEL [--streaming | --no-streaming] [--resume] [--offload-activations DIR]``: streaming
PTQ (``ptq.streaming``), one decoder layer in memory at a time, with a progress line per layer; the checkpoint is
the one the in-memory command writes.

Streaming is the default wherever it can serve (``streaming_decision``): a local Hugging Face safetensors
directory, a GGUF file of an architecture transformers reads tensor by tensor (the built-in ``smollm2-135m``
is one), a hub name (its safetensors snapshot downloaded first). Otherwise the command says why in one line and
loads the model whole: ``stories260k`` (not a transformers checkpoint), a GGUF that transformers assembles
across the file (MoE GGUFs), ``--eval`` (perplexity needs the whole model), torchrun (ranks calibrate
data-parallel on the whole model). ``--no-streaming`` always loads it whole; ``--streaming`` makes any of
those an error.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..export.common import jsonable
from .common import parse_dtype, show_progress

STREAMING_ONLY = ("resume", "offload_activations")
#: what a hub snapshot downloads for streaming: config, weights, tokenizer (no pickles, no GGUF)
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken")


def _hub_name(model: str) -> bool:
    return not Path(model).expanduser().exists() and "/" in model and not model.startswith((".", "/", "~"))


def why_not_streamed(args) -> Optional[str]:
    """Why ``blockscale quantize`` cannot stream ``args.model`` with these flags, or None."""
    from ..models.hf_streaming import check_source, is_gguf
    from ..train.distributed import env_world

    if args.eval:
        return "--eval measures perplexity on the whole model"
    if getattr(args, "rotate", "none") not in (None, "none"):
        return f"--rotate {args.rotate} rotates the whole model before PTQ"
    if getattr(args, "auto_recipe", False):
        return "--auto-recipe measures sensitivities with backward passes through the whole model"
    if env_world()[1] > 1:
        return "under torchrun the ranks calibrate data-parallel on the whole model"
    model = str(args.model)
    if model.lower() == "stories260k":
        return "stories260k is not a transformers checkpoint"
    if model.lower() in ("smollm2-135m", "smollm2") or _hub_name(model):
        return None
    p = Path(model).expanduser()
    if not p.exists():
        return None  # the in-memory loader names what is missing
    if not p.is_dir() and not is_gguf(p):
        return f"{model} is neither a directory nor a .gguf file"
    try:
        check_source(p)  # (a corrupt file is a CheckpointError either way: not a reason to load it whole)
    except UsageError as e:
        return str(e).split(": ", 1)[-1]
    return None


def streaming_decision(args) -> tuple[bool, Optional[str]]:
    """(stream?, the line a default run that cannot stream prints): --no-streaming loads the model whole,
    --streaming streams or is a UsageError naming why it cannot, no flag streams where it can (under torchrun:
    never, silently: the ranks calibrate data-parallel)."""
    from ..train.distributed import env_world

    if args.streaming is False or (args.streaming is None and env_world()[1] > 1):
        return False, None  # (torchrun: data-parallel calibration of the whole model is what was asked for)
    why = why_not_streamed(args)
    if why is None:
        return True, None
    if args.streaming:
        raise UsageError(f"--streaming: {why}; leave out --streaming (or give --no-streaming) to load it whole")
    return False, f"not streaming {args.model}: {why}; loading it whole"


def streaming_source(model: str) -> Path:
    """The local source streaming reads for ``model``: the built-in SmolLM2 GGUF, a hub name's safetensors
    snapshot (downloaded), or the path itself (checked: ``check_streaming_source``)."""
    from ..ptq.streaming import check_streaming_source

    if model.lower() in ("smollm2-135m", "smollm2"):
        from ..models.hf import smollm2_gguf

        return check_streaming_source(str(smollm2_gguf()))
    if _hub_name(model):
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(model, allow_patterns=list(HUB_PATTERNS))
        except Exception as e:  # noqa: BLE001 -- hub / network errors of every kind, one line
            raise UsageError(f"{model}: could not download its safetensors snapshot from the Hugging Face hub "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give a local "
                             "directory, or --no-streaming") from None
        return check_streaming_source(local)
    return check_streaming_source(model)


def check_streaming_flags(args) -> Optional[str]:
    """--resume / --offload-activations need streaming; returns the fallback line (``streaming_decision``)."""
    stream, line = streaming_decision(args)
    args.streaming = stream
    if not stream:
        for flag in STREAMING_ONLY:
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')} needs streaming"
                                 + (f", but {line.split(': ', 1)[1].split('; loading')[0]}" if line else ""))
        return line
    from ..ptq.stream_state import work_dir_for
    from ..ptq.streaming import check_offload_dir

    p = Path(args.model).expanduser()
    if args.out is not None and args.offload_activations is not None and p.exists():
        out = Path(args.out).expanduser().absolute()
        check_offload_dir(args.offload_activations, p.absolute(), out, work_dir_for(out))
    return None


def run_streaming(args, cfg, recipe, defaults, prog: str) -> int:
    from ..data.text_sources import calibration_batches
    from ..export import size_breakdown
    from ..models.hf import open_tokenizer
    from ..ptq.fused_experts import experts_summary
    from ..models.hf_streaming import is_gguf
    from ..ptq.streaming import quantize_streaming
    from .quantize import no_tokenizer_error, quantize_reported

    src = streaming_source(str(args.model))
    # None: a weights-only directory (RTN W4A16 still works)
    tok = open_tokenizer(src.parent, gguf_file=src.name) if is_gguf(src) else open_tokenizer(src)
    if cfg.needs_calibration and tok is None:
        raise no_tokenizer_error(args, cfg, recipe)
    calib = args.calib or defaults.calib
    batches = None
    if cfg.needs_calibration:
        batches = calibration_batches(tok, calib, cfg.n_samples, cfg.seq_len, seed=cfg.seed,
                                      bos=defaults.calib_bos if args.calib is None else args.calib_bos)
    print(f"streaming {args.model} layer by layer ...", flush=True)
    t0 = [time.time()]
    n_layers = []

    def on_layer(i, phase, model):
        if not n_layers:  # (the first call: every Linear of the layers is still an nn.Linear)
            from ..ptq.capture import decoder_layers

            n_layers.append(len(decoder_layers(model)))
        if phase == "released":
            print(f"layer {i + 1}/{n_layers[0]} quantized and written ({time.time() - t0[0]:.1f} s)", flush=True)
            t0[0] = time.time()

    def summary(report):
        report.config["calibration_source"] = calib if batches is not None else None
        return jsonable({"model": args.model, "method": cfg.label, "config": report.config,
                         "seconds": report.seconds, "calibration_tokens": report.calibration_tokens,
                         "perplexity": None})

    def extra(report):
        return {"ptq_report.json": jsonable({"model": args.model, "ptq": report.to_dict()})}

    out = Path(args.out)
    report = quantize_reported(prog, lambda: quantize_streaming(
        src, out, cfg, batches, args.format, dtype=parse_dtype(args.dtype), device=args.device,
        tokenizer=tok.hf if tok else None, max_shard_size=args.max_shard_size, metadata=summary, extra_files=extra,
        overwrite=args.overwrite, resume=args.resume, offload_activations=args.offload_activations,
        progress=show_progress(), on_layer=on_layer), defaulted=args.skip_indivisible is None)
    print(f"quantized {len(report.linears)} linear layers ({cfg.label}) in {report.seconds:.1f} s (streaming); kept "
          f"in high precision: {', '.join(report.kept_high_precision) or 'none'}")
    line = experts_summary(report.experts)
    if line is not None:
        print(line)
    print(f"wrote {args.format} checkpoint to {out.absolute()} (report: {out.absolute() / 'ptq_report.json'})")
    print(f"{size_breakdown(out)}; unquantized tensors are {args.dtype} (--dtype)")
    return 0


def add_streaming_flags(q) -> None:
    g = q.add_argument_group("streaming (models larger than memory)")
    g.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="load one decoder layer at a time from MODEL (safetensors shards of a local or hub Hugging "
                        "Face model, or a GGUF file), quantize it, write its tensors and release it: the default where "
                        "the model allows it (otherwise one line says why and it loads whole); --streaming makes that "
                        "an error, --no-streaming always loads the model whole. The same checkpoint either way")
    g.add_argument("--resume", action="store_true",
                   help="streaming: continue an interrupted run from its work directory (.OUT.streaming next "
                        "to --out) at the first unfinished layer")
    g.add_argument("--offload-activations", metavar="DIR",
                   help="streaming: keep the calibration activations between layers in DIR instead of memory")


__all__ = ["add_streaming_flags", "check_streaming_flags", "run_streaming", "streaming_decision", "streaming_source",
           "why_not_streamed"]
