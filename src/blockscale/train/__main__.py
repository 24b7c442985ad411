"""``python -m blockscale.train``: argparse -> TrainConfig -> train. Works under torchrun too.

    python -m blockscale.train --data tinystories --model-preset tiny --steps 50 --out runs/x
    torchrun --nproc_per_node 2 -m blockscale.train --data shakespeare --steps 50 --out runs/ddp

Every TrainConfig field is a flag (``--batch-size``, ``--lr``, ``--no-progress``, ...).
Text is tokenized as UTF-8 bytes (vocab 256); the model is a Llama preset with that vocabulary.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from ..quant.backend import BACKENDS
from .data import BUILTIN, load_data
from .distributed import env_world
from .trainer import CheckpointError, TrainConfig, plot_losses, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m blockscale.train", description="Pretrain a small Llama on text.")
    p.add_argument("--data", required=True, help=f"a text file or a built-in corpus: {', '.join(BUILTIN)}")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of the tokens held out")
    p.add_argument("--model-preset", default="tiny", help="a blockscale.models.llama.PRESETS name")
    p.add_argument("--out", "--out-dir", dest="out_dir", default=None, help="run folder (metrics, ckpt, plot)")
    p.add_argument("--recipe", default=None,
                   help="train with quantized linear layers: a built-in recipe (bf16, mxfp8, nvfp4-nvidia, "
                        "nvfp4-nvidia-4over6, nvfp4-fwd-mxfp8-bwd) or a recipe YAML file (default: plain FP32)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="quantizer kernels (compiled: torch.compile; triton: Triton kernels, which run on CUDA "
                        "tensors; both bit-identical to the reference)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/ckpt.pt if present")
    p.add_argument("--no-plot", action="store_true", help="do not write <out>/loss.png")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default; 1 is fastest for tiny models on busy cores)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "out_dir":
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                           help=f"disable {f.name}")
        elif isinstance(default, tuple):
            p.add_argument(flag, type=float, nargs=len(default), default=default, help=f"(default: {default})")
        else:
            p.add_argument(flag, type=type(default), default=default, help=f"(default: {default})")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def build_model(preset: str, vocab_size: int, seq_len: int, seed: int) -> torch.nn.Module:
    """A Llama from ``PRESETS[preset]`` with the data's vocabulary and room for ``seq_len``."""
    from ..models.llama import PRESETS, Llama

    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r}: expected one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    config = dataclasses.replace(base, vocab_size=vocab_size, max_seq_len=max(base.max_seq_len, seq_len))
    return Llama(config, seed=seed)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        cfg = config_from_args(args)
        data = load_data(args.data, val_fraction=args.val_fraction)
        model = build_model(args.model_preset, data.vocab_size, cfg.seq_len, cfg.seed)
        rank = env_world()[0]
        if args.recipe:
            from ..nn import convert
            from ..quant import set_backend

            set_backend(args.backend)
            report = convert(model, args.recipe)
            if rank == 0:
                print(report, flush=True)
        if rank == 0:
            n = sum(p.numel() for p in model.parameters())
            print(f"model {args.model_preset}: {n:,} parameters; data {args.data}: "
                  f"{data.train.numel():,} train / {data.val.numel():,} val tokens", flush=True)
        result = train(model, data, cfg, resume=args.resume)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        print(f"python -m blockscale.train: error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(f"done: step {result.step}, train loss {result.final_train_loss}, val loss {result.final_val_loss}")
        if cfg.out_dir and not args.no_plot and result.metrics_path is not None:
            try:
                png = plot_losses({args.model_preset: result.metrics_path}, f"{cfg.out_dir}/loss.png",
                                  title=f"{args.model_preset} on {args.data}")
                print(f"loss plot: {png}")
            except ImportError:
                print("matplotlib not installed: no loss plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
