"""Training: the one training loop (``loop.run_training``; pretraining and LSQ distillation are two tasks
on it), pretraining small decoder LMs on byte/any-tokenizer data, torchrun support, training checkpoints.

    from blockscale.train import TrainConfig, load_data, train
    result = train(model, load_data("tinystories"), TrainConfig(steps=200, out_dir="runs/x"))

CLI: ``python -m blockscale.train --data tinystories --model-preset tiny --steps 50 --out runs/x``
(also under ``torchrun --nproc_per_node N -m blockscale.train ...``).
"""
from .checkpoint import (CheckpointContents, TrainingCheckpointError, load_training_checkpoint,
                         save_training_checkpoint)
from .token_data import BUILTIN, ByteTokenizer, TokenData, derive_seed, load_data, resolve_source
from .distributed import DistInfo, cleanup_distributed, setup_distributed
from .gradients import clip_gradients
from .loop import LoopConfig, StepReport, TrainingDivergedError, TrainingTask, TrainResult, run_training
from .metrics import plot_losses, read_metrics
from .trainer import PretrainTask, TrainConfig, evaluate, get_lr, make_optimizer, train

__all__ = [
    "BUILTIN", "ByteTokenizer", "CheckpointContents", "DistInfo", "LoopConfig", "PretrainTask", "StepReport",
    "TokenData", "TrainConfig", "TrainResult", "TrainingCheckpointError", "TrainingDivergedError", "TrainingTask", "cleanup_distributed",
    "clip_gradients", "derive_seed", "evaluate", "get_lr", "load_data", "load_training_checkpoint", "make_optimizer",
    "plot_losses", "read_metrics", "resolve_source", "run_training", "save_training_checkpoint", "setup_distributed",
    "train",
]
