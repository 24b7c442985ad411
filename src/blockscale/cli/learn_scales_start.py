"""``learn-scales --method auto``: the PTQ start chosen among ``lsq.START_CANDIDATES`` by each candidate's
next-token loss on the held-out training windows (the ones that later choose the step; ``lsq.choose_start``)."""
from __future__ import annotations

from ..errors import UsageError
from .quantize import given_method_flags

AUTO = "auto"


def candidate_names() -> str:
    from ..lsq.start_selection import START_CANDIDATES

    return ", ".join(c.label for c in START_CANDIDATES)


def add_candidates_argument(p) -> None:
    p.add_argument("--candidates", default=None, metavar="LABEL,...",
                   help=f"with --method auto: the starts to try, comma-separated, in the order given (a tie keeps the "
                        f"earlier; default every one: {candidate_names()})")


def selected_candidates(args) -> tuple:
    """The ``lsq.START_CANDIDATES`` named by ``--candidates`` (all of them when not given); UsageError for an
    unknown or repeated label."""
    from ..lsq.start_selection import START_CANDIDATES

    if args.candidates is None:
        return START_CANDIDATES
    by_label = {c.label: c for c in START_CANDIDATES}
    labels = [x.strip() for x in args.candidates.split(",")]
    bad = [x for x in labels if x not in by_label]
    if bad:
        raise UsageError(f"--candidates {args.candidates!r}: {bad[0]!r} is not a start; allowed (comma-separated): "
                         f"{candidate_names()}")
    repeated = [x for i, x in enumerate(labels) if x in labels[:i]]
    if repeated:
        raise UsageError(f"--candidates {args.candidates!r}: {repeated[0]!r} is named twice")
    return tuple(by_label[x] for x in labels)


def check_auto_start(args, holdout: int) -> None:
    """The flags --method auto cannot be combined with, before anything loads (``holdout``: the held-out windows
    the run will have)."""
    if args.method != AUTO:
        if args.candidates is not None:
            raise UsageError(f"--candidates {args.candidates!r}: only with --method auto (it lists the starts that "
                             "--method auto tries)")
        return
    selected_candidates(args)
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
                                 seed=args.seed, bos=defaults.calib_bos, holdout=holdout)
    held = lsq.split_holdout(tokens, holdout)[1]
    candidates = selected_candidates(args)
    print(f"--method auto: quantizing with each of {', '.join(c.label for c in candidates)}; keeping the lowest "
          f"next-token loss on the {held.shape[0]} held-out training windows", flush=True)
    choice = choose_start(model, tokenizer, base, defaults.calib, held, defaults.calib_bos, candidates,
                          batch_size=args.batch_size, progress=progress, run=run,
                          log=lambda line: print(line, flush=True))
    print(f"start: {choice.label}", flush=True)
    return choice.student, choice.to_dict()


__all__ = ["AUTO", "add_candidates_argument", "auto_start", "candidate_names", "check_auto_start",
           "selected_candidates"]
