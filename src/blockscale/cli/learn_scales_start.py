"""``learn-scales --method auto``: the PTQ start chosen among ``lsq.START_CANDIDATES`` by each candidate's
next-token loss on the held-out training windows (the ones that later choose the step; ``lsq.choose_start``)."""
from __future__ import annotations

from ..errors import UsageError
from .quantize import given_method_flags

AUTO = "auto"


def candidate_names() -> str:
    from ..lsq.start_selection import START_CANDIDATES

    return ", ".join(c.label for c in START_CANDIDATES)


def check_auto_start(args, holdout: int) -> None:
    """The flags --method auto cannot be combined with, before anything loads (``holdout``: the held-out windows
    the run will have)."""
    if args.method != AUTO:
        return
    clash = [f for f, v in (("--scale-rule", args.scale_rule), ("--recipe", args.recipe)) if v]
    clash += given_method_flags(args)
    if clash:
        raise UsageError(f"{', '.join(clash)}: --method auto tries its own PTQ starts ({candidate_names()}) with "
                         "their own scale rules and options; drop these flags or name one --method")
    if getattr(args, "fsdp", False):
        raise UsageError("--method auto holds a whole quantized copy of the model per candidate; with --fsdp name "
                         "one --method instead")
    if holdout == 0:
        why = "--holdout 0" if args.holdout is not None else f"--holdout 0 by default for --n-samples {args.n_samples}"
        raise UsageError(f"--method auto chooses the start by the loss on the held-out training windows, and there "
                         f"are none ({why}); give --holdout N or name one --method")


def auto_start(args, model, tokenizer, base, defaults, holdout: int, run, progress: bool):
    """(``lsq.QuantizedStudent`` of the chosen start, ``StartChoice.to_dict()``): every candidate quantized from
    ``base`` (the run's activations, calibration windows and rotation) and scored on the last ``holdout`` of the
    run's training windows."""
    from .. import lsq
    from ..data.text_sources import calibration_batches
    from ..lsq.start_selection import choose_start

    tokens = calibration_batches(tokenizer, args.data or defaults.calib, args.n_samples, args.seq_len,
                                 seed=args.seed, bos=defaults.calib_bos)
    held = lsq.split_holdout(tokens, holdout)[1]
    print(f"--method auto: quantizing with each of {candidate_names()}; keeping the lowest next-token loss on the "
          f"{held.shape[0]} held-out training windows", flush=True)
    choice = choose_start(model, tokenizer, base, defaults.calib, held, defaults.calib_bos,
                          batch_size=args.batch_size, progress=progress, run=run,
                          log=lambda line: print(line, flush=True))
    print(f"start: {choice.label}", flush=True)
    return choice.student, choice.to_dict()


__all__ = ["AUTO", "auto_start", "candidate_names", "check_auto_start"]
