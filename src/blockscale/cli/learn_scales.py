"""``blockscale learn-scales``: make a quantized model's NVFP4 block scales trainable, distill from the
full-precision teacher, export with the learned scales.

The teacher is an explicit ``--teacher MODEL``. A checkpoint's metadata names the model it was made
from, but metadata is untrusted: it is used only with ``--teacher-from-metadata``, and only when it is a
built-in name or a hub name (org/name), never a local path.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .checks import (MAX_BATCH, MAX_EVAL_TOKENS, MAX_SAMPLES, MAX_SEED, MAX_SEQ_LEN, MAX_STEPS, check_device,
                         check_model, check_out, check_product, check_run_dir, check_text, number)
from .common import (add_common, add_skip_indivisible, check_eval_ctx, checkpoint_formats, jsonable, local_path,
                     resolve_ptq_recipe, setup, show_progress)
from .quantize import quantize_reported, skip_indivisible
from ..errors import UsageError

DEFAULT_LR_SCALES = 3e-3  # --param amax: docs/results/scale-learning.md
DEFAULT_LR_SCALES_LOG = 3e-3  # --param log (the default): lsq.RECOVERY_LR_SCALES, docs/results/recovery.md
DEFAULT_LR_WEIGHTS = 5e-5  # --train all: lsq.RECOVERY_LR_WEIGHTS, docs/results/recovery.md
DEFAULT_MODE = "dual"  # value scales on the PTQ grid (with DEFAULT_LR_PRE_FACTOR): docs/results/recovery.md
DEFAULT_PARAM = "log"
DEFAULT_SCHEDULE = "cosine"
DEFAULT_LR_PRE_FACTOR = 0.0  # --mode dual: the pre amaxes (codes) stay at the PTQ scales (docs/lsq.md "Dual scales")
INIT_METHODS = ("rtn", "awq", "smoothquant", "gptq")
MAX_LR = 1e6  # Adam's first step moves a tensor by up to 10 lr: far below FP32's range, far above any useful lr


def default_lr_scales(param: str) -> float:
    """--lr-scales when not given: per parameterisation (a raw-amax lr and a log-amax lr are different units)."""
    return DEFAULT_LR_SCALES_LOG if param == "log" else DEFAULT_LR_SCALES


def default_warmup(steps: int) -> int:
    """--warmup-steps when not given: a tenth of the run (0 below 10 steps)."""
    return steps // 10


def scales_stuck(steps_per_scale_step: float, steps: int) -> bool:
    """Whether the run is too short for a typical block scale to move by one E4M3 step at all
    (``lsq.steps_per_scale_step``'s estimate exceeds ``--steps``): then --lr-scales is too small."""
    return steps_per_scale_step > steps


HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def teacher_from_metadata(ckpt: Path, recorded) -> str:
    """The recorded source model of ``ckpt`` when it is a built-in or hub name that is not also a local path."""
    from ..models.hf import BUILTIN_MODELS

    if recorded is None:
        raise UsageError(f"--teacher-from-metadata: the metadata of {ckpt} names no source model; pass --teacher "
                         "MODEL (the full-precision model)")
    builtin = recorded.lower() in BUILTIN_MODELS or recorded.lower() == "smollm2"
    hub = bool(HUB_NAME.fullmatch(recorded)) and ".." not in recorded
    if not (builtin or hub) or Path(recorded).expanduser().exists():
        raise UsageError(f"--teacher-from-metadata: the metadata of {ckpt} names {recorded!r}, which is not a "
                         "built-in or hub model name (a local path from metadata is never loaded); pass --teacher "
                         "MODEL")
    return recorded


def resolve_teacher(args, ckpt: Path) -> str:
    """The teacher of a checkpoint input: --teacher, or with --teacher-from-metadata the recorded name."""
    from ..models.hf import source_model

    if args.teacher and args.teacher_from_metadata:
        raise UsageError("--teacher and --teacher-from-metadata both name the teacher: give one of them")
    if args.teacher:
        check_model(args.teacher, "--teacher")
        return args.teacher
    recorded = source_model(ckpt)
    if args.teacher_from_metadata:
        return teacher_from_metadata(ckpt, recorded)
    if recorded is None:
        raise UsageError(f"{ckpt} is a quantized checkpoint: pass the full-precision teacher with --teacher MODEL")
    raise UsageError(f"{ckpt} is a quantized checkpoint: pass the full-precision teacher with --teacher MODEL (its "
                     f"metadata names the source model {recorded!r}; pass --teacher-from-metadata to use that name)")


def default_ckpt_interval(steps: int) -> int:
    """--ckpt-interval when not given: a tenth of the run, at least every step and at most every 50."""
    return max(1, min(50, steps // 10))


def resolve_model_teacher(args) -> str:
    """The teacher of a model-name input: --teacher (a model that shares its tokenizer), else the model itself."""
    if args.teacher_from_metadata:
        raise UsageError("--teacher-from-metadata: only with a quantized checkpoint input (its metadata names the "
                         f"source model); {args.model} is a model, its own teacher unless --teacher says otherwise")
    if args.teacher:
        check_model(args.teacher, "--teacher")
        return args.teacher
    return args.model


def same_model(a: str, b: str) -> bool:
    """Whether two model arguments name the same model (one name, or paths to one file or directory)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def _rank_device(device: str) -> str:
    """Under torchrun plain "cuda" means this rank's GPU (cuda:LOCAL_RANK)."""
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _init_recipe(args, is_ckpt: bool):
    """The PTQ recipe of the RTN initialisation (--recipe, with an explicit --scale-rule applied to its NVFP4
    schemes); None without --recipe. A checkpoint input was quantized already: --recipe / --scale-rule /
    --w4a4 are usage errors there."""
    if is_ckpt:
        given = [f for f, v in (("--recipe", args.recipe), ("--scale-rule", args.scale_rule), ("--w4a4", args.w4a4),
                                ("--method", args.method)) if v]
        if given:
            raise UsageError(f"{', '.join(given)}: the input {args.model} is a quantized checkpoint already; these "
                             "flags choose the PTQ initialisation of a model name")
        return None
    if args.recipe is None:
        return None
    if args.w4a4:
        raise UsageError("--w4a4 cannot be combined with --recipe: the recipe sets each scheme's activations")
    recipe = resolve_ptq_recipe(args.recipe)
    return recipe.with_nvfp4(scale_rule=args.scale_rule) if args.scale_rule else recipe


def check_loaded_vocabulary(model: str, teacher: str, student_lm, teacher_lm, compare_tokenizers: bool) -> None:
    """After loading (for what the configs did not say): the teacher's vocabulary is the student's; with
    ``compare_tokenizers`` also their tokenizers' token -> id maps, when both have transformers tokenizers."""
    from ..models.vocabulary import check_same_vocabulary, model_vocab_size

    maps = [None, None]
    if compare_tokenizers:
        toks = [getattr(lm.tokenizer, "hf", None) for lm in (student_lm, teacher_lm)]
        if all(t is not None and hasattr(t, "get_vocab") for t in toks):
            maps = [t.get_vocab() for t in toks]
    check_same_vocabulary(model, teacher, model_vocab_size(student_lm.model), model_vocab_size(teacher_lm.model),
                          *maps)


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


def cmd_learn_scales(args) -> int:
    import copy

    import torch

    from .. import lsq
    from ..export import export_checkpoint
    from ..models.hf import is_blockscale_checkpoint, load_model
    from ..models.vocabulary import check_same_vocabulary, declared_vocab_size
    from ..train import TrainingDivergedError
    from ..ptq import PTQConfig
    from ..ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl, open_model, record_dict
    from ..data.text_sources import calibration_batches

    setup(args)
    check_model(args.model)
    if getattr(args, "fsdp", False) and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise UsageError("--fsdp needs a torchrun job with at least 2 processes (torchrun --nproc_per_node 2 -m "
                         "blockscale.cli learn-scales ...); without torchrun drop --fsdp")
    _check_schedule_flags(args)
    device = _rank_device(check_device(args.device))
    check_product(("--n-samples", args.n_samples), ("--seq-len", args.seq_len), what="training tokens")
    check_product(("--batch-size", args.batch_size), ("--seq-len", args.seq_len), what="tokens per micro step")
    check_text(args.data, "--data")
    if args.eval not in (None, "default"):
        check_text(args.eval, "--eval")
    path = Path(args.model)
    is_ckpt = path.is_dir() and is_blockscale_checkpoint(path)
    recipe = _init_recipe(args, is_ckpt)
    teacher_name = resolve_teacher(args, path) if is_ckpt else resolve_model_teacher(args)
    own_teacher = not is_ckpt and same_model(teacher_name, args.model)
    if not own_teacher:  # before anything loads: the vocabularies the two configs declare
        check_same_vocabulary(args.model, teacher_name, declared_vocab_size(args.model),
                              declared_vocab_size(teacher_name))
    out = check_out(args.out, overwrite=args.overwrite, sources=[local_path(args.model), local_path(teacher_name)])
    train_dir = check_run_dir(str(out) + ".train", "--out")
    defaults = default_texts(args.model)
    if is_ckpt:
        student_lm = open_model(args.model, device=device, verify=not args.no_verify)
        teacher_lm = load_model(teacher_name, device=device)
        check_loaded_vocabulary(args.model, teacher_name, student_lm, teacher_lm, compare_tokenizers=False)
        tokenizer = teacher_lm.tokenizer  # the checkpoint's own tokenizer may be absent
        weights, ptq_report = None, None  # latent weights: the checkpoint's dequantized weights
    else:
        base_lm = load_model(args.model, device=device)
        teacher_lm = base_lm if own_teacher else load_model(teacher_name, device=device)
        if not own_teacher:
            check_loaded_vocabulary(args.model, teacher_name, base_lm, teacher_lm, compare_tokenizers=True)
        tokenizer = base_lm.tokenizer
        student_lm = copy.copy(base_lm)
        student_lm.model = copy.deepcopy(base_lm.model)
        flat = {} if recipe is not None else dict(scale_rule=args.scale_rule or "6",
                                                  activations="w4a4" if args.w4a4 else "w4a16")
        cfg = PTQConfig(method=args.method or "rtn", recipe=recipe, **flat,
                        skip_indivisible=skip_indivisible(args.skip_indivisible, args.model),
                        n_samples=args.n_samples, seq_len=args.seq_len)
        latent = {}
        ptq_report = quantize_reported("blockscale learn-scales", lambda: calibrate_and_quantize(
            student_lm.model, tokenizer, cfg, defaults.calib, defaults.calib_bos,
            progress=show_progress(), latent_weights=latent), defaulted=args.skip_indivisible is None).to_dict()
        # the full-precision weights PTQ rounded (after AWQ / SmoothQuant folding) where they reproduce its codes
        # (RTN-like methods), else the dequantized ones (GPTQ): the step-0 model equals the PTQ model either way
        for name, m in base_lm.model.named_modules():  # fused experts: the full-precision ones (RTN: exact)
            for key in ("gate_up_proj", "down_proj"):
                if isinstance(getattr(m, key, None), torch.Tensor) and getattr(m, key).dim() == 3:
                    latent.setdefault(f"{name}.{key}", getattr(m, key).detach())
        weights, dequantized = lsq.exact_latent_weights(student_lm.model, latent)
        if dequantized:
            print(f"latent weights: {len(weights) - len(dequantized)} of {len(weights)} Linears start from the "
                  f"full-precision weights PTQ rounded, {len(dequantized)} from their dequantized weights "
                  f"({cfg.method}'s codes are not a rounding of one weight)", flush=True)
    if tokenizer is None:
        raise UsageError(f"learn-scales trains on text, but {teacher_name if is_ckpt else args.model} has no "
                         "tokenizer (save one next to the weights)")
    try:
        lsq.enable(student_lm.model, mode=args.mode, init="stored", weights=weights, param=args.param,
                   dual_form=args.dual_form, learn_input_scales=args.learn_input_scales)
    except ValueError as err:
        if not args.learn_input_scales:
            raise
        raise UsageError(f"--learn-input-scales: {err}") from None
    lr_scales = args.lr_scales if args.lr_scales is not None else default_lr_scales(args.param)
    warmup = args.warmup_steps if args.warmup_steps is not None else default_warmup(args.steps)
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 evaluates and writes
    med, n_steps = lsq.steps_per_scale_step(student_lm.model, lr_scales)
    if main_rank:
        units = ("(Adam moves each log amax by about that much per step: a relative step, the same on every model)"
                 if args.param == "log" else
                 f"(median block amax {med:.3g}; Adam moves an amax by about that much per step)")
        print(f"--lr-scales {lr_scales:g} {units}: a typical block scale needs ~{n_steps:.0f} steps to move by one "
              "E4M3 step" + ("; consider a larger --lr-scales (docs/lsq.md)" if scales_stuck(n_steps, args.steps)
                             else ""), flush=True)
    tokens = calibration_batches(tokenizer, args.data or defaults.calib, args.n_samples, args.seq_len,
                                 seed=args.seed, bos=defaults.calib_bos)
    ckpt_every = args.ckpt_interval if args.ckpt_interval is not None else default_ckpt_interval(args.steps)
    dual_pair = args.mode == "dual" and args.dual_form == "pair"
    lr_pre_factor = args.lr_pre_factor if args.lr_pre_factor is not None else (DEFAULT_LR_PRE_FACTOR if dual_pair else 1.0)
    dcfg = lsq.DistillConfig(train=args.train, steps=args.steps, lr_scales=lr_scales, lr_weights=args.lr_weights,
                             batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
                             temperature=args.temperature, ce_weight=args.ce_weight, seed=args.seed,
                             out_dir=str(train_dir), fsdp=bool(getattr(args, "fsdp", False)),
                             fsdp_param_dtype=getattr(args, "fsdp_param_dtype", "fp32"),
                             lr_schedule=args.lr_schedule, warmup_steps=warmup if args.lr_schedule != "constant" else 0,
                             min_lr_ratio=args.min_lr_ratio, lr_pre_factor=lr_pre_factor,
                             freeze_pre_steps=args.freeze_pre_steps, ckpt_every=ckpt_every)
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
    report = {"model": args.model, "teacher": teacher_name, "mode": args.mode, "train": args.train, "ptq": ptq_report}
    evals = {}

    def ppl(tag):
        if args.eval and main_rank:
            src = defaults.eval if args.eval == "default" else args.eval
            if tag == "before":
                check_eval_ctx("blockscale learn-scales", student_lm.model, defaults.ctx, False)
            rec = evaluate_ppl(student_lm.model, tokenizer, src, defaults.ctx, defaults.bos,
                               args.max_eval_tokens)
            evals[tag] = record_dict(rec)
            print(f"perplexity {tag}: {rec.ppl:.4f} ({rec.tokens_evaluated} tokens of {rec.source})", flush=True)

    ppl("before")
    try:
        report["distill"] = lsq.distill(student_lm.model, teacher_lm.model, tokens, dcfg, resume=args.resume,
                                        progress=show_progress(), record=record, force=args.force)
    except TrainingDivergedError as err:
        raise TrainingDivergedError(f"{err} (--lr-scales {lr_scales:g}"
                                    + (f", --lr-weights {args.lr_weights:g}" if args.train == "all" else "")
                                    + f"); nothing was exported to {out}", err.step, err.checkpoint) from None
    if not main_rank:
        return 0
    ppl("after")
    if evals:  # as in quantize's ptq_report.json: no key without --eval (the metadata says null)
        report["perplexity"] = evals
    lsq.freeze(student_lm.model)
    meta = {"model": teacher_name if is_ckpt else args.model,  # a summary; details: lsq_report.json
            "scale_learning": {"mode": args.mode, "train": args.train, "steps": args.steps,
                               "perplexity": evals or None}}
    if not is_ckpt and not own_teacher:
        meta["scale_learning"]["teacher"] = teacher_name
    tok = tokenizer.hf if tokenizer else None
    dest = export_checkpoint(student_lm.model, out, args.format, tokenizer=tok, metadata=jsonable(meta),
                             overwrite=args.overwrite, source=[p for p in (local_path(args.model),
                                                                           local_path(teacher_name)) if p],
                             extra_files={"lsq_report.json": jsonable(report)})
    print(f"wrote {args.format} checkpoint with learned scales to {dest} (training files: {dcfg.out_dir})")
    return 0


def add_learn_scales(sub) -> None:
    from ..lsq import DUAL_FORMS, LR_SCHEDULES, LSQ_MODES, LSQ_PARAMS

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
    number(p, "--lr-weights", float, lo=0.0, hi=MAX_LR, default=DEFAULT_LR_WEIGHTS,
           help="peak Adam learning rate of the latent weights (raw units; used with --train all)")
    number(p, "--temperature", float, lo=0.0, lo_open=True, default=1.0)
    number(p, "--ce-weight", float, lo=0.0, default=0.0, help="weight of the next-token loss mixed into T^2 KL")
    number(p, "--batch-size", int, lo=1, hi=MAX_BATCH, default=4)
    number(p, "--grad-accum", int, lo=1, hi=MAX_BATCH, default=1)
    p.add_argument("--data", help="training text (default: the model's calibration text)")
    number(p, "--n-samples", int, lo=1, hi=MAX_SAMPLES, default=256, help="training windows drawn from --data")
    number(p, "--seq-len", int, lo=2, hi=MAX_SEQ_LEN, default=256)
    p.add_argument("--method", default=None, choices=INIT_METHODS,
                   help="PTQ method of the initialisation (model names only; default rtn; its default options)")
    p.add_argument("--scale-rule", default=None, choices=("6", "4over6", "sweep", "hessian", "hessian-4over6"),
                   help="RTN init (model names only; default 6; with --recipe: its NVFP4 schemes' rule)")
    p.add_argument("--recipe", help="RTN init with a PTQ recipe (model names only): a built-in name (blockscale "
                                    "recipes --ptq) or a YAML file; only its NVFP4 modules learn their scales")
    p.add_argument("--w4a4", action="store_true", help="PTQ init with NVFP4 activations (model names only)")
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
                   help="under torchrun (>= 2 processes): shard student and teacher with FSDP2 instead of DDP "
                        "(sharded checkpoints OUT.train/latest.dcp; docs/lsq.md)")
    p.add_argument("--fsdp-param-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="mixed precision of --fsdp for everything but the LSQ learners (always fp32); gradients are "
                        "reduced in fp32")
    add_common(p)
    p.set_defaults(func=cmd_learn_scales)


__all__ = ["DEFAULT_LR_SCALES", "DEFAULT_LR_SCALES_LOG", "DEFAULT_LR_WEIGHTS", "DEFAULT_MODE", "MAX_LR",
           "add_learn_scales", "check_loaded_vocabulary", "cmd_learn_scales", "default_ckpt_interval",
           "default_lr_scales", "default_warmup", "resolve_model_teacher", "resolve_teacher", "same_model",
           "scales_stuck", "teacher_from_metadata"]
