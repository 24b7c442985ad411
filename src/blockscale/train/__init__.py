"""Pretraining small decoder LMs: byte/any-tokenizer data, the training loop, torchrun support.

    from blockscale.train import TrainConfig, load_data, train
    result = train(model, load_data("tinystories"), TrainConfig(steps=200, out_dir="runs/x"))

CLI: ``python -m blockscale.train --data tinystories --model-preset tiny --steps 50 --out runs/x``
(also under ``torchrun --nproc_per_node N -m blockscale.train ...``).
"""
from .data import BUILTIN, ByteTokenizer, TokenData, derive_seed, load_data, resolve_source
from .distributed import DistInfo, cleanup_distributed, setup_distributed
from .trainer import (CheckpointError, TrainConfig, TrainResult, clip_gradients, evaluate, get_lr,
                      load_checkpoint, make_optimizer, plot_losses, read_metrics, save_checkpoint, train)

__all__ = [
    "BUILTIN", "ByteTokenizer", "CheckpointError", "DistInfo", "TokenData", "TrainConfig", "TrainResult",
    "cleanup_distributed", "clip_gradients", "derive_seed", "evaluate", "get_lr", "load_checkpoint",
    "load_data", "make_optimizer", "plot_losses", "read_metrics", "resolve_source", "save_checkpoint",
    "setup_distributed", "train",
]
