"""``python -m blockscale.train`` (also ``blockscale train``): argparse -> TrainConfig -> train. Works under
torchrun too.

    python -m blockscale.train --data tinystories --model-preset tiny --steps 50 --out runs/x
    torchrun --nproc_per_node 2 -m blockscale.train --data shakespeare --steps 50 --out runs/ddp

Every TrainConfig field is a flag (``--batch-size``, ``--lr``, ``--no-progress``, ...); every value is
checked before training (finite floats, integers in range, a device this machine has, a writable --out).
Text is tokenized as UTF-8 bytes (vocab 256); the model is a Llama preset with that vocabulary. The
checkpoint records the recipe and the model config; ``--resume`` refuses a checkpoint recording others
unless ``--force``. Errors print one line ``blockscale train: error: ...`` (exit 2: a bad flag, 1: a
runtime error; ``--debug`` shows the traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

from .checks import MAX_THREADS, check_device, check_float, check_int, check_run_dir, flag_name
from .common import resolve_recipe
from .expert_parallel import add_expert_parallel_flags, expert_parallel_config
from .reporting import ArgumentParser, run_reported
from ..errors import DataError, UsageError
from ..models.llama import PRESETS
from ..quant.backend import BACKENDS
from ..train.token_data import BUILTIN, load_data, resolve_source
from ..train.distributed import env_world
from ..train.trainer import TrainConfig, check_train_values, train

PROG = "blockscale train"
_FLAGS = {"out_dir": "--out"}
_CHOICES = {"autocast": ("auto", "bf16", "none"), "fsdp_param_dtype": ("fp32", "bf16")}
_HELP = {"autocast": "bf16 autocast: auto (on CUDA with bf16 support), bf16 (also on CPU: slow) or none",
         "device": "auto, cpu, cuda or cuda:N",
         "warmup_steps": "linear LR warmup steps (a warmup >= --steps warns: the LR never reaches --lr)",
         "eval_batches": "validation batches per evaluation (0: none)",
         "eval_interval": "evaluate every N steps (0: only at the end)",
         "ckpt_interval": "save ckpt.pt every N steps (0: only at the end)",
         "fsdp": "shard with FSDP2 per decoder block instead of DDP (under torchrun, >= 2 processes; sharded "
                 "checkpoints in <out>/ckpt.dcp; docs/recipes.md, FSDP2)",
         "fsdp_param_dtype": "mixed precision of --fsdp: parameters all-gathered in fp32 (no casts) or bf16; "
                             "gradients reduced in fp32",
         "fsdp_cpu_offload": "with --fsdp on GPUs: FSDP2's CPU offload policy (shards and optimizer state in CPU "
                             "memory, each unit copied to the GPU for its forward / backward)",
         "activation_checkpointing": "recompute each decoder block's activations in backward instead of keeping "
                                     "them (less memory, about one more forward of time)"}
_BOOL_HELP = {"progress": "no progress bars", "plot": "do not write <out>/loss.png"}


def _choices(names) -> str:
    """A metavar listing the allowed values (checked by ``_check_args``, whose errors name the flag)."""
    return "{" + ",".join(names) + "}"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Pretrain a small Llama on text.")
    p.add_argument("--data", required=True, help=f"a text file or a built-in corpus: {', '.join(BUILTIN)}")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of the tokens held out")
    p.add_argument("--model-preset", default="tiny", metavar=_choices(PRESETS), help="the Llama size")
    p.add_argument("--out", "--out-dir", dest="out_dir", default=None, help="run folder (metrics, ckpt, plot)")
    p.add_argument("--recipe", default=None,
                   help="train with quantized linear layers: a built-in recipe (bf16, mxfp8, nvfp4-nvidia, "
                        "nvfp4-nvidia-4over6, nvfp4-fwd-mxfp8-bwd) or a recipe YAML file (default: plain FP32)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="quantizer kernels (compiled: torch.compile; triton: Triton kernels, which run on CUDA "
                        "tensors; both bit-identical to the reference)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/ckpt.pt if present")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue even if the checkpoint records another recipe or model config")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default; 1 is fastest for tiny models on busy cores)")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error (default: one line)")
    add_expert_parallel_flags(p)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "out_dir":
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if default is False:  # an opt-in switch (--fsdp)
            p.add_argument(flag, dest=f.name, action="store_true", help=_HELP.get(f.name))
        elif isinstance(default, bool):
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                           help=_BOOL_HELP.get(f.name, f"disable {f.name}"))
        elif isinstance(default, tuple):
            p.add_argument(flag, type=float, nargs=len(default), default=default, help=_HELP.get(f.name))
        else:
            p.add_argument(flag, type=type(default), default=default, help=_HELP.get(f.name),
                           **({"metavar": _choices(_CHOICES[f.name])} if f.name in _CHOICES else {}))
    return p


def _flag_label(name: str, value) -> str:
    """How a TrainConfig value is named in errors: its flag and the value given (``--min-lr nan``; a switch
    given: its flag alone)."""
    if value is True:
        return _FLAGS.get(name, flag_name(name))
    shown = " ".join(f"{v:g}" for v in value) if isinstance(value, (tuple, list)) else \
        f"{value:g}" if isinstance(value, float) else str(value)
    return f"{_FLAGS.get(name, flag_name(name))} {shown}"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the flags; a bad value is a UsageError naming its flag."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    check_train_values(values, label=_flag_label, error=UsageError)
    return TrainConfig(**values)


def build_model(preset: str, vocab_size: int, seq_len: int, seed: int, meta: bool = False) -> torch.nn.Module:
    """A Llama from ``PRESETS[preset]`` with the data's vocabulary and room for ``seq_len``; ``meta``: on the
    meta device (--fsdp: each rank fills its own shards with the seed's values, ``train.fsdp_source``)."""
    from ..models.llama import PRESETS, Llama

    if preset not in PRESETS:
        raise UsageError(f"--model-preset {preset!r}: expected one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    config = dataclasses.replace(base, vocab_size=vocab_size, max_seq_len=max(base.max_seq_len, seq_len))
    if meta:
        with torch.device("meta"):
            return Llama(config, seed=seed)
    return Llama(config, seed=seed)


def _check_args(args):
    """Every flag before any work: returns (TrainConfig, recipe or None)."""
    from ..models.llama import PRESETS

    check_int(args.threads, "--threads", 0, MAX_THREADS)
    check_float(args.val_fraction, "--val-fraction", 0.0, 1.0, hi_open=True)
    check_device(args.device, allow_auto=True)
    cfg = config_from_args(args)
    if args.model_preset not in PRESETS:
        raise UsageError(f"--model-preset {args.model_preset!r}: expected one of {', '.join(PRESETS)}")
    try:
        resolve_source(args.data)
    except FileNotFoundError as exc:
        raise UsageError(f"--data {args.data}: {exc}") from None
    recipe = resolve_recipe(args.recipe) if args.recipe else None
    if cfg.out_dir:
        check_run_dir(cfg.out_dir, "--out")
    elif args.resume:
        raise UsageError("--resume needs --out (the run folder holding ckpt.pt)")
    if cfg.fsdp and env_world()[1] < 2:
        raise UsageError("--fsdp needs a torchrun job with at least 2 processes (torchrun --nproc_per_node 2 -m "
                         "blockscale.train ...); without torchrun drop --fsdp")
    if cfg.fsdp_cpu_offload:
        from ..train.device import resolve_device
        from ..train.fsdp import check_cpu_offload

        check_cpu_offload(True, resolve_device(cfg.device, env_world()[2], env_world()[1]))
    return cfg, recipe


def _load(args, cfg):
    try:
        data = load_data(args.data, val_fraction=args.val_fraction)
    except ValueError as exc:
        raise DataError(f"--data {args.data}: {exc}") from None
    need = cfg.seq_len + 1
    if data.train.numel() < need + 1:
        raise DataError(f"--data {args.data} has {data.train.numel():,} training tokens: too few for --seq-len "
                        f"{cfg.seq_len}")
    if cfg.eval_batches and data.val.numel() < need + 1:
        raise DataError(f"--data {args.data} holds out {data.val.numel():,} validation tokens (--val-fraction "
                        f"{args.val_fraction:g}): too few for --seq-len {cfg.seq_len}; raise --val-fraction or pass "
                        "--eval-batches 0")
    return data


def _run(args) -> int:
    from ..recipes import recipe_to_dict

    cfg, recipe = _check_args(args)
    comm = expert_parallel_config(args, cfg)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    data = _load(args, cfg)
    model = build_model(args.model_preset, data.vocab_size, cfg.seq_len, cfg.seed, meta=cfg.fsdp)
    record = {"recipe": recipe_to_dict(recipe) if recipe is not None else None,
              "model": dataclasses.asdict(model.config)}
    rank = env_world()[0]
    if recipe is not None:
        from ..nn import convert
        from ..quant import set_backend

        set_backend(args.backend)
        report = convert(model, recipe)
        if rank == 0:
            print(report, flush=True)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"model {args.model_preset}: {n:,} parameters; data {args.data}: "
              f"{data.train.numel():,} train / {data.val.numel():,} val tokens", flush=True)
    result = train(model, data, cfg, resume=args.resume, record=record, force=args.force, expert_parallel=comm)
    for name, loss in (("train", result.final_train_loss), ("validation", result.final_val_loss)):
        if loss is not None and not math.isfinite(loss):
            raise DataError(f"training diverged: the final {name} loss is {loss} (lower --lr, check --data)")
    if rank == 0:
        val = "" if result.final_val_loss is None else f", val loss {result.final_val_loss:.4f}"
        if result.already_finished:  # train() said "already finished at step N"
            if result.final_val_loss is not None:
                print(f"val loss {result.final_val_loss:.4f}")
        else:
            print(f"done: step {result.step}, train loss {result.final_train_loss:.4f}{val}")
        if result.plot_path is not None:
            print(f"loss plot: {result.plot_path}")
        elif cfg.out_dir and cfg.plot and result.metrics_path is not None:
            print("matplotlib not installed: no loss plot")
    return 0


def main(argv=None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    return run_reported(prog, lambda: _run(args), debug=args.debug)

