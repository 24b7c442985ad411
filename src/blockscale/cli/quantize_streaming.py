"""``blockscale quantize MODEL --streaming [--resume] [--offload-activations DIR]``: streaming PTQ
(``ptq.streaming``) of a local Hugging Face safetensors directory, one decoder layer in memory at a time,
with a progress line per layer; the checkpoint is the one the in-memory command writes."""
from __future__ import annotations

import time
from pathlib import Path

from ..errors import UsageError
from ..export.common import jsonable
from .common import parse_dtype, show_progress

STREAMING_ONLY = ("resume", "offload_activations")


def check_streaming_flags(args) -> None:
    """--resume / --offload-activations need --streaming; --streaming cannot --eval (the model is never whole)."""
    if not getattr(args, "streaming", False):
        for flag in STREAMING_ONLY:
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')} needs --streaming")
        return
    if args.eval:
        raise UsageError("--eval cannot be combined with --streaming (the whole model is never in memory); evaluate "
                         "the written checkpoint with: blockscale eval ppl OUT")
    from ..ptq.stream_state import work_dir_for
    from ..ptq.streaming import check_offload_dir, check_streaming_source

    src = check_streaming_source(args.model)
    if args.out is not None:
        out = Path(args.out).expanduser().absolute()
        check_offload_dir(args.offload_activations, src, out, work_dir_for(out))


def run_streaming(args, cfg, recipe, defaults, prog: str) -> int:
    from ..data.text_sources import calibration_batches
    from ..export import size_breakdown
    from ..models.hf import open_tokenizer
    from ..ptq.fused_experts import experts_summary
    from ..ptq.streaming import check_streaming_source, quantize_streaming
    from .quantize import no_tokenizer_error, quantize_reported

    src = check_streaming_source(args.model)
    tok = open_tokenizer(src)  # None: a weights-only directory (RTN W4A16 still works)
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
    g.add_argument("--streaming", action="store_true",
                   help="load one decoder layer at a time from MODEL's safetensors shards (a local Hugging Face "
                        "directory), quantize it, write its tensors and release it; the same checkpoint as without")
    g.add_argument("--resume", action="store_true",
                   help="with --streaming: continue an interrupted run from its work directory (.OUT.streaming next "
                        "to --out) at the first unfinished layer")
    g.add_argument("--offload-activations", metavar="DIR",
                   help="with --streaming: keep the calibration activations between layers in DIR instead of memory")


__all__ = ["add_streaming_flags", "check_streaming_flags", "run_streaming"]
