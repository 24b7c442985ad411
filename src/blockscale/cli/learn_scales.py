"""``blockscale learn-scales``: make a quantized model's NVFP4 block scales trainable, distill from the
full-precision teacher, export with the learned scales.

The teacher is an explicit ``--teacher MODEL``. A checkpoint's metadata names the model it was made
from, but metadata is untrusted: it is used only with ``--teacher-from-metadata``, and only when it is a
built-in name or a hub name (org/name), never a local path.
"""
from __future__ import annotations

import os
from pathlib import Path

from .checks import (MAX_BATCH, MAX_EVAL_TOKENS, MAX_SAMPLES, MAX_SEED, MAX_SEQ_LEN, MAX_STEPS, check_device,
                         check_model, check_out, check_product, check_run_dir, check_text, number)
from .common import (add_common, add_skip_indivisible, check_eval_ctx, checkpoint_formats, local_path, setup,
                     show_progress)
from ..export.common import jsonable
from .learn_scales_sharded import (add_sharding_flags, check_sharding_flags, return_large_frees,
                                   sharded_checkpoint_student, sharded_teacher, sharding_note, streamed_student,
                                   teacher_dtype)
from .learn_scales_init import add_init_arguments, init_recipe, ptq_config
from .learn_scales_start import AUTO, add_candidates_argument, auto_start, check_auto_start
from .learn_scales_teacher import (check_loaded_vocabulary, resolve_model_teacher, resolve_teacher, same_model,
                                   teacher_from_metadata)
from .quantize import add_method_flags, method_names, quantize_reported
from .ranks import is_main_rank, rank_device
from .rotation_flags import check_learn_scales_rotation
from ..errors import UsageError
from .learn_scales_defaults import (DEFAULT_LR_PRE_FACTOR, DEFAULT_LR_SCALES, DEFAULT_LR_SCALES_LOG, DEFAULT_LR_WEIGHTS,
                                    DEFAULT_LR_WEIGHTS_BLOCK, DEFAULT_MODE, DEFAULT_PARAM, DEFAULT_SCHEDULE,
                                    DEFAULT_WEIGHT_UNITS, MAX_LR, default_ckpt_interval, default_holdout,
                                    default_lr_scales, default_lr_weights, default_select_every, default_warmup,
                                    scales_stuck)


def _check_schedule_flags(args) -> None:
    """Combinations of the schedule / dual / input-scale flags, before anything is loaded."""
    if args.warmup_steps is not None and args.warmup_steps and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps {args.warmup_steps}: must be fewer than --steps {args.steps}")
    if (args.lr_pre_factor is not None or args.freeze_pre_steps) and not (args.mode == "dual"
                                                                          and args.dual_form == "pair"):
        raise UsageError("--lr-pre-factor / --freeze-pre-steps: only with --mode dual --dual-form pair (the pre amaxes "
                         "that set the codes' grid)")
    if args.learn_input_scales and not Path(args.model).is_dir() and not args.w4a4 and not args.recipe:
        raise UsageError("--learn-input-scales learns W4A4 activation scales: add --w4a4 (or a W4A4 --recipe / "
                         "checkpoint)")
    check_learn_scales_rotation(args)


def _check_flags(args) -> str:
    """Every flag on its own and in combination, before anything loads; returns this rank's device."""
    setup(args)
    check_model(args.model)
    if getattr(args, "fsdp", False) and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise UsageError("--fsdp needs a torchrun job with at least 2 processes (torchrun --nproc_per_node 2 -m "
                         "blockscale.cli learn-scales ...); without torchrun drop --fsdp")
    _check_schedule_flags(args)
    device = rank_device(check_device(args.device))
    check_sharding_flags(args, device)
    check_product(("--n-samples", args.n_samples), ("--seq-len", args.seq_len), what="training tokens")
    if args.holdout is not None and args.holdout >= args.n_samples:
        raise UsageError(f"--holdout {args.holdout}: must be fewer than --n-samples {args.n_samples} (the held-out "
                         "windows choose the step; the others train)")
    if args.lr_retries and holdout(args) == 0:
        why = "--holdout 0" if args.holdout is not None else f"--holdout 0 by default for --n-samples {args.n_samples}"
        raise UsageError(f"--lr-retries {args.lr_retries}: a retry needs held-out windows that choose the step, and "
                         f"there are none ({why}); give --holdout N or drop --lr-retries")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.holdout and getattr(args, "fsdp", False) and args.holdout % world:
        raise UsageError(f"--holdout {args.holdout}: with --fsdp a multiple of the {world} processes")
    check_auto_start(args, holdout(args))
    check_product(("--batch-size", args.batch_size), ("--seq-len", args.seq_len), what="tokens per micro step")
    check_text(args.data, "--data")
    if args.eval not in (None, "default"):
        check_text(args.eval, "--eval")
    return device


def _quantized_student(args, teacher_name: str, own_teacher: bool, recipe, defaults, device: str):
    """(student, teacher, tokenizer, latent weights, PTQ report) of a model-name input: the student is the model
    quantized here (``lsq.quantize_student``), the teacher the model itself unless --teacher names another."""
    from .. import lsq
    from ..models.hf import load_model

    base_lm = load_model(args.model, device=device)
    teacher_lm = base_lm if own_teacher else load_model(teacher_name, device=device)
    if not own_teacher:
        check_loaded_vocabulary(args.model, teacher_name, base_lm, teacher_lm, compare_tokenizers=True)
    cfg = ptq_config(args, recipe)
    run = lambda ptq: quantize_reported("blockscale learn-scales", ptq,  # noqa: E731
                                        defaulted=args.skip_indivisible is None)
    if args.method == AUTO:
        qs, choice = auto_start(args, base_lm.model, base_lm.tokenizer, cfg, defaults, holdout(args), run,
                                show_progress())
    else:
        qs, choice = lsq.quantize_student(base_lm.model, base_lm.tokenizer, cfg, defaults.calib, defaults.calib_bos,
                                          progress=show_progress(), run=run), None
    if qs.dequantized:
        print(f"latent weights: {len(qs.weights) - len(qs.dequantized)} of {len(qs.weights)} Linears start from the "
              f"full-precision weights PTQ rounded, {len(qs.dequantized)} from their dequantized weights "
              f"({cfg.method}'s codes are not a rounding of one weight)", flush=True)
    report = dict(qs.report.to_dict(), **({"start_selection": choice} if choice else {}))
    return qs.model, teacher_lm.model, base_lm.tokenizer, qs.weights, report


def _distill_config(args, train_dir: Path):
    """The ``lsq.DistillConfig`` of the flags (their defaults filled in)."""
    from .. import lsq

    lr_scales = args.lr_scales if args.lr_scales is not None else default_lr_scales(args.param)
    warmup = args.warmup_steps if args.warmup_steps is not None else default_warmup(args.steps)
    ckpt_every = args.ckpt_interval if args.ckpt_interval is not None else default_ckpt_interval(args.steps)
    dual_pair = args.mode == "dual" and args.dual_form == "pair"
    lr_pre_factor = args.lr_pre_factor if args.lr_pre_factor is not None else (DEFAULT_LR_PRE_FACTOR if dual_pair else 1.0)
    return lsq.DistillConfig(train=args.train, steps=args.steps, lr_scales=lr_scales, lr_weights=lr_weights(args),
                             batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
                             temperature=args.temperature, ce_weight=args.ce_weight, seed=args.seed,
                             out_dir=str(train_dir), fsdp=bool(getattr(args, "fsdp", False)),
                             fsdp_param_dtype=getattr(args, "fsdp_param_dtype", "fp32"),
                             lr_schedule=args.lr_schedule, warmup_steps=warmup if args.lr_schedule != "constant" else 0,
                             min_lr_ratio=args.min_lr_ratio, lr_pre_factor=lr_pre_factor,
                             freeze_pre_steps=args.freeze_pre_steps, ckpt_every=ckpt_every,
                             eval_every=args.select_every or default_select_every(args.steps),
                             lr_retries=args.lr_retries if args.lr_retries is not None else lsq.RECOVERY_LR_RETRIES)


def lr_weights(args) -> float:
    return args.lr_weights if args.lr_weights is not None else default_lr_weights(args.weight_units)


def holdout(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1")) if getattr(args, "fsdp", False) else 1
    return args.holdout if args.holdout is not None else default_holdout(args.n_samples, world)


def _run_record(args, is_ckpt: bool, recipe, teacher_name: str) -> dict:
    """What defines the run beyond the DistillConfig (checked when resuming)."""
    record = {"model": args.model, "teacher": teacher_name, "mode": args.mode, "train": args.train,
              "scale_rule": None if is_ckpt else (args.scale_rule or "6"), "w4a4": None if is_ckpt else args.w4a4}
    if recipe is not None:  # (absent otherwise, so older run directories still resume)
        record["recipe"] = recipe.name
    if args.method not in (None, "rtn"):
        record["method"] = args.method
    if (args.param, args.dual_form) != ("amax", "pair"):  # the units the run's amaxes are in
        record.update(param=args.param, dual_form=args.dual_form)
    if args.learn_input_scales:
        record["learn_input_scales"] = True
    if args.act_scale_rule not in (None, "6"):
        record["act_scale_rule"] = args.act_scale_rule
    if args.train == "all" and args.weight_units != "raw":
        record["weight_units"] = args.weight_units
    return record


def _print_scale_steps(args, student, lr_scales: float) -> None:
    """On rank 0: how many steps a typical block scale needs to move by one E4M3 step at ``lr_scales``."""
    from .. import lsq

    med, n_steps = lsq.steps_per_scale_step(student, lr_scales)
    if not lsq.is_main_rank():
        return
    units = ("(Adam moves each log amax by about that much per step: a relative step, the same on every model)"
             if args.param == "log" else
             f"(median block amax {med:.3g}; Adam moves an amax by about that much per step)")
    print(f"--lr-scales {lr_scales:g} {units}: a typical block scale needs ~{n_steps:.0f} steps to move by one "
          "E4M3 step" + ("; consider a larger --lr-scales (docs/lsq.md)" if scales_stuck(n_steps, args.steps)
                         else ""), flush=True)


def _evaluator(args, tokenizer, defaults):
    """``lsq.recover``'s ``evaluate`` for --eval (None without it): the perplexity, printed."""
    from .. import lsq

    if not args.eval:
        return None
    measure = lsq.perplexity_evaluator(tokenizer, defaults.eval if args.eval == "default" else args.eval,
                                       defaults.ctx, defaults.bos, args.max_eval_tokens)

    def evaluate(model, tag: str) -> dict:
        if tag == "before" and lsq.is_main_rank():  # (a warning only: rank 0 says it)
            check_eval_ctx("blockscale learn-scales", model, defaults.ctx, False)
        rec = measure(model, tag)
        if lsq.is_main_rank():  # (a sharded student is evaluated by every rank together)
            print(f"perplexity {tag}: {rec['ppl']:.4f} ({rec['tokens_evaluated']} tokens of {rec['source']})",
                  flush=True)
        return rec

    return evaluate


def _recovery_config(args, dcfg):
    from .. import lsq

    return lsq.RecoveryConfig(dcfg, mode=args.mode, param=args.param, dual_form=args.dual_form,
                              learn_input_scales=args.learn_input_scales, weight_units=args.weight_units,
                              holdout=holdout(args))


def _on_enabled(args, lr_scales: float, enabled: bool):
    """After the scales are trainable: the --lr-scales line and (a student not sharded yet) activation
    checkpointing of its decoder blocks."""
    from ..train.fsdp import checkpoint_blocks

    def on_enabled(model):
        _print_scale_steps(args, model, lr_scales)
        if args.activation_checkpointing and not enabled:
            checkpoint_blocks(model)
    return on_enabled


def _recover(args, student, teacher, tokenizer, weights, defaults, dcfg, record: dict, out: Path,
             enabled: bool = False):
    """``lsq.recover`` with the flags' options; its errors in the command line's words."""
    from .. import lsq
    from ..data.text_sources import calibration_batches
    from ..train import TrainingDivergedError

    config = _recovery_config(args, dcfg)

    def tokens():  # drawn once the scales are trainable (after the --lr-scales line); the held-out windows last,
        # from the end of the text (disjoint from the training windows)
        return calibration_batches(tokenizer, args.data or defaults.calib, args.n_samples, args.seq_len,
                                   seed=args.seed, bos=defaults.calib_bos, holdout=config.holdout)

    try:
        return lsq.recover(student, teacher, tokens, config, weights=weights,
                           evaluate=_evaluator(args, tokenizer, defaults),
                           on_enabled=_on_enabled(args, dcfg.lr_scales, enabled), resume=args.resume,
                           record=record, force=args.force, progress=show_progress(), enabled=enabled)
    except lsq.ScaleSetupError as err:
        if not args.learn_input_scales:
            raise err.__cause__ from None
        raise UsageError(f"--learn-input-scales: {err}") from None
    except TrainingDivergedError as err:
        raise TrainingDivergedError(f"{err} (--lr-scales {dcfg.lr_scales:g}"
                                    + (f", --lr-weights {lr_weights(args):g}" if args.train == "all" else "")
                                    + f"); nothing was exported to {out}", err.step, err.checkpoint) from None


def _export(args, student, tokenizer, out: Path, teacher_name: str, own_teacher: bool, is_ckpt: bool,
            report: dict):
    """Write the student with its learned scales, the run's summary in the metadata and lsq_report.json."""
    from ..export import export_checkpoint

    meta = {"model": teacher_name if is_ckpt else args.model,  # a summary; details: lsq_report.json
            "scale_learning": {"mode": args.mode, "train": args.train, "steps": args.steps,
                               "perplexity": report.get("perplexity")}}
    if not is_ckpt and not own_teacher:
        meta["scale_learning"]["teacher"] = teacher_name
    tok = tokenizer.hf if tokenizer else None
    return export_checkpoint(student, out, args.format, tokenizer=tok, metadata=jsonable(meta),
                             overwrite=args.overwrite, source=[p for p in (local_path(args.model),
                                                                           local_path(teacher_name)) if p],
                             extra_files={"lsq_report.json": jsonable(report)})


def _teacher(args, teacher_name: str, sharded: bool, device: str):
    """(teacher model, its tokenizer) of a run whose student was not loaded with it: built sharded (``--fsdp``
    and a streamable source) or loaded whole in --teacher-dtype."""
    from ..models.hf import load_model

    if sharded:
        from ..models.hf import open_tokenizer
        from ..models.hf_streaming import is_gguf
        from .quantize_streaming import streaming_source

        teacher, _ = sharded_teacher(teacher_name, args, device)
        src = streaming_source(teacher_name)
        return teacher, open_tokenizer(src.parent, gguf_file=src.name) if is_gguf(src) else open_tokenizer(src)
    lm = load_model(teacher_name, device=device, dtype=teacher_dtype(args))
    return lm.model, lm.tokenizer


def _learn(args, is_ckpt, recipe, teacher_name, own_teacher, defaults, device, dcfg, out, student_sharded,
           teacher_sharded):
    """Build student and teacher (sharded as they are built where ``*_sharded``), then ``_recover``; returns
    (recovery result, student, tokenizer, PTQ report)."""
    from ..models.vocabulary import check_same_vocabulary, model_vocab_size

    record = _run_record(args, is_ckpt, recipe, teacher_name)
    weights, enabled, recovery = None, False, _recovery_config(args, dcfg)
    if is_ckpt:  # the quantized student whole on every rank (its packed codes), its scales enabled block by block
        from ..ptq.pipeline import open_model

        student, ptq_report = open_model(args.model, device=device, verify=not args.no_verify).model, None
        teacher, tokenizer = _teacher(args, teacher_name, teacher_sharded, device)
        check_same_vocabulary(args.model, teacher_name, model_vocab_size(student), model_vocab_size(teacher))
        if args.fsdp:
            student, enabled = sharded_checkpoint_student(student, recovery, args), True
    elif student_sharded:
        built, tokenizer, ptq_report = streamed_student(args, ptq_config(args, recipe), defaults, recovery,
                                                        show_progress() and is_main_rank())
        student, enabled = built.model, True
        if built.dequantized and is_main_rank():
            print(f"latent weights: {len(built.dequantized)} Linears start from their dequantized weights (the "
                  "PTQ method's codes are not a rounding of one weight)", flush=True)
        teacher, _ = _teacher(args, teacher_name, teacher_sharded, device)
        if not own_teacher:
            check_same_vocabulary(args.model, teacher_name, model_vocab_size(student), model_vocab_size(teacher))
    else:
        student, teacher, tokenizer, weights, ptq_report = _quantized_student(args, teacher_name, own_teacher,
                                                                               recipe, defaults, device)
        if args.teacher_dtype != "fp32":
            teacher.to(teacher_dtype(args))
    if tokenizer is None:
        raise UsageError(f"learn-scales trains on text, but {teacher_name if is_ckpt else args.model} has no "
                         "tokenizer (save one next to the weights)")
    result = _recover(args, student, teacher, tokenizer, weights, defaults, dcfg, record, out, enabled=enabled)
    return result, student, tokenizer, ptq_report


def cmd_learn_scales(args) -> int:
    from .. import lsq
    from ..models.hf import is_blockscale_checkpoint
    from ..train.distributed import cleanup_distributed, setup_distributed
    from ..models.vocabulary import check_same_vocabulary, declared_vocab_size
    from ..ptq.pipeline import default_texts

    device = _check_flags(args)
    path = Path(args.model)
    is_ckpt = path.is_dir() and is_blockscale_checkpoint(path)
    recipe = init_recipe(args, is_ckpt)
    teacher_name = resolve_teacher(args, path) if is_ckpt else resolve_model_teacher(args)
    own_teacher = not is_ckpt and same_model(teacher_name, args.model)
    if not own_teacher:  # before anything loads: the vocabularies the two configs declare
        check_same_vocabulary(args.model, teacher_name, declared_vocab_size(args.model),
                              declared_vocab_size(teacher_name))
    out = check_out(args.out, overwrite=args.overwrite, sources=[local_path(args.model), local_path(teacher_name)])
    train_dir = check_run_dir(str(out) + ".train", "--out")
    defaults = default_texts(args.model)
    dcfg = _distill_config(args, train_dir)
    student_sharded, teacher_sharded, note = sharding_note(args, is_ckpt, teacher_name)
    if args.fsdp:
        return_large_frees()
    if note and lsq.is_main_rank():
        print(note, flush=True)
    info = setup_distributed(device) if student_sharded or teacher_sharded else None
    try:
        result, student, tokenizer, ptq_report = _learn(args, is_ckpt, recipe, teacher_name, own_teacher, defaults,
                                                        device, dcfg, out, student_sharded, teacher_sharded)
    finally:
        if info is not None:
            cleanup_distributed(info)
    if not result.main_rank:
        return 0
    report = {"model": args.model, "teacher": teacher_name, "mode": args.mode, "train": args.train, "ptq": ptq_report}
    report["distill"] = result.distill
    if result.evaluations:  # as in quantize's ptq_report.json: no key without --eval (the metadata says null)
        report["perplexity"] = result.evaluations
    dest = _export(args, student, tokenizer, out, teacher_name, own_teacher, is_ckpt, report)
    print(f"wrote {args.format} checkpoint with learned scales to {dest} (training files: {dcfg.out_dir})")
    return 0


def add_learn_scales(sub) -> None:
    from ..lsq import DUAL_FORMS, LR_SCHEDULES, LSQ_MODES, LSQ_PARAMS, WEIGHT_UNITS

    p = sub.add_parser("learn-scales", help="learn NVFP4 block scales by distillation from the full-precision model",
                       description="Make the NVFP4 block scales of a quantized model trainable (LSQ, tied or dual), "
                                   "distill from the full-precision model, export with the learned scales.")
    p.add_argument("model", help="an NVFP4 checkpoint directory (with --teacher), or a model name / path (the "
                                 "teacher; quantized here with RTN first)")
    p.add_argument("--out", required=True, help="output checkpoint directory (training files: OUT.train)")
    p.add_argument("--teacher", help="the full-precision model of a checkpoint input; with a model input another "
                                     "model to distill from (the same tokenizer; default: the model itself)")
    p.add_argument("--teacher-from-metadata", action="store_true",
                   help="use the source model named in the checkpoint's metadata as the teacher (only a built-in "
                        "or hub name, never a local path)")
    p.add_argument("--mode", default=DEFAULT_MODE, choices=LSQ_MODES,
                   help="dual (default): codes on the grid of the pre amaxes, values scaled by the post amaxes (with the "
                        "default --lr-pre-factor 0 the pre amaxes stay at the PTQ scales); tied: one amax per block for "
                        "both (the write-up's default)")
    p.add_argument("--param", default=DEFAULT_PARAM, choices=LSQ_PARAMS,
                   help="units of the learned block amaxes: log (relative to the PTQ amax: one lr is the same relative "
                        "step on every model; default) or amax (raw, the write-up's)")
    p.add_argument("--dual-form", default="pair", choices=DUAL_FORMS,
                   help="with --mode dual: pair (independent pre / post amaxes, the write-up's) or ratio (post = pre * a "
                        "learned ratio)")
    p.add_argument("--train", default="scales", choices=("scales", "all"),
                   help="scales only (default), or the latent weights too (the recovery pipeline: --scale-rule hessian "
                        "--train all; docs/results/recovery.md)")
    number(p, "--steps", int, lo=1, hi=MAX_STEPS, default=100)
    number(p, "--lr-scales", float, lo=0.0, lo_open=True, hi=MAX_LR, default=None,
           help=f"peak Adam learning rate of the block scales (default {DEFAULT_LR_SCALES_LOG:g} with --param log, "
                f"{DEFAULT_LR_SCALES:g} with --param amax: docs/results/recovery.md)")
    p.add_argument("--lr-schedule", default=DEFAULT_SCHEDULE, choices=LR_SCHEDULES,
                   help="learning-rate schedule of every group: cosine (default) or linear decay to --min-lr-ratio "
                        "after --warmup-steps, or constant")
    number(p, "--warmup-steps", int, lo=0, hi=MAX_STEPS, default=None, help="linear warm-up steps (default: --steps / 10)")
    number(p, "--min-lr-ratio", float, lo=0.0, hi=1.0, default=0.0, help="the decayed lr, relative to the peak")
    number(p, "--lr-pre-factor", float, lo=0.0, default=None,
           help="with --mode dual --dual-form pair: the pre amaxes' lr relative to --lr-scales (default 0: they stay "
                "at the PTQ scales, only the value scales learn, the fix for the write-up's 1, which diverges: "
                "docs/lsq.md)")
    number(p, "--freeze-pre-steps", int, lo=0, hi=MAX_STEPS, default=0,
           help="with --mode dual --dual-form pair: the pre amaxes stay frozen for the first N steps")
    number(p, "--lr-weights", float, lo=0.0, hi=MAX_LR, default=None,
           help=f"peak Adam learning rate of the latent weights (--train all; default {DEFAULT_LR_WEIGHTS_BLOCK:g} with "
                f"--weight-units block, {DEFAULT_LR_WEIGHTS:g} with raw)")
    p.add_argument("--weight-units", default=DEFAULT_WEIGHT_UNITS, choices=WEIGHT_UNITS,
                   help="units of the latent weights (--train all): block (relative to each block's scale: one lr is "
                        "the same share of a quantization step on every model; default) or raw")
    number(p, "--holdout", int, lo=0, hi=MAX_SAMPLES, default=None,
           help="training windows held out to choose the step, drawn from the end of the text (no token shared with "
                "the windows trained on): the student keeps the step (the start included) with the lowest "
                "distillation loss on them (default: --n-samples / 32; 0: the last step)")
    number(p, "--lr-retries", int, lo=0, hi=8, default=None,
           help="when the step kept is the start (learning never beat it on the held-out windows), put the start back "
                "and run again at a third of every learning rate, at most N times (default 1; 0: never)")
    number(p, "--select-every", int, lo=1, hi=MAX_STEPS, default=None,
           help="evaluate the held-out windows every N steps (default: --steps / 5)")
    number(p, "--temperature", float, lo=0.0, lo_open=True, default=1.0)
    number(p, "--ce-weight", float, lo=0.0, default=0.0, help="weight of the next-token loss mixed into T^2 KL")
    number(p, "--batch-size", int, lo=1, hi=MAX_BATCH, default=4)
    number(p, "--grad-accum", int, lo=1, hi=MAX_BATCH, default=1)
    p.add_argument("--data", help="training text (default: the model's calibration text)")
    number(p, "--n-samples", int, lo=1, hi=MAX_SAMPLES, default=256, help="training windows drawn from --data")
    number(p, "--seq-len", int, lo=2, hi=MAX_SEQ_LEN, default=256)
    p.add_argument("--method", default=None, choices=method_names() + (AUTO,),
                   help="PTQ method of the initialisation (model names only; default rtn; its options: the "
                        "--awq-* / --gptq-* / ... flags, as for quantize); auto: each of lsq.START_CANDIDATES, "
                        "keeping the lowest next-token loss on the held-out training windows")
    add_candidates_argument(p)
    add_init_arguments(p)
    p.add_argument("--learn-input-scales", action="store_true",
                   help="W4A4: learn each Linear's activation outer scale too (its clipping level; docs/lsq.md)")
    add_skip_indivisible(p)
    p.add_argument("--eval", nargs="?", const="default", help="perplexity before and after (optional source)")
    number(p, "--max-eval-tokens", int, lo=2, hi=MAX_EVAL_TOKENS)
    p.add_argument("--format", default="compressed-tensors", choices=checkpoint_formats())
    number(p, "--seed", int, lo=0, hi=MAX_SEED, default=0)
    p.add_argument("--device", default="cpu", help="device of the student and teacher (e.g. cuda; under torchrun "
                                                   "cuda means each rank's own GPU)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the content digests of a checkpoint input (values are still checked)")
    number(p, "--ckpt-interval", int, lo=0, hi=MAX_STEPS, default=None,
           help="write OUT.train/latest.pt every N steps, for --resume (0: only at the end; default: --steps / 10, "
                "at least every step and at most every 50)")
    p.add_argument("--resume", action="store_true", help="continue from OUT.train/latest.pt (bit for bit on CPU)")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue even if the checkpoint was written with another model, teacher "
                        "or mode")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out directory if it is a blockscale checkpoint")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun (>= 2 processes): shard student and teacher with FSDP2 instead of DDP, each "
                        "built shard by shard so no rank holds the whole model (sharded checkpoints "
                        "OUT.train/latest.dcp; docs/lsq.md)")
    p.add_argument("--fsdp-param-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="mixed precision of --fsdp for everything but the LSQ learners (always fp32); gradients are "
                        "reduced in fp32")
    add_sharding_flags(p)
    add_method_flags(p)  # the --method's options (model names only), as for quantize
    add_common(p)
    p.set_defaults(func=cmd_learn_scales)


__all__ = ["DEFAULT_LR_SCALES", "DEFAULT_LR_SCALES_LOG", "DEFAULT_LR_WEIGHTS", "DEFAULT_MODE", "MAX_LR",
           "add_learn_scales", "check_loaded_vocabulary", "cmd_learn_scales", "default_ckpt_interval",
           "default_lr_scales", "default_warmup", "resolve_model_teacher", "resolve_teacher", "same_model",
           "scales_stuck", "teacher_from_metadata"]
