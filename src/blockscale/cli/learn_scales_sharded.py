"""``blockscale learn-scales --fsdp`` without materialising the model on any rank: the student built by a
streamed, data-parallel PTQ that shards each layer as it is quantized (``lsq.sharded_student``), the teacher
built on the meta device and filled with each rank's own rows (``train.fsdp_source``), both sharded with FSDP2;
the flags that shape it (``--teacher-dtype``, ``--fsdp-cpu-offload``, ``--activation-checkpointing``).

A source that cannot be streamed (stories260k, a GGUF of an architecture transformers reads whole, e.g. MoE)
takes the earlier path, with one line saying so: each rank loads it whole, then shards.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..errors import UsageError

TEACHER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_sharding_flags(p) -> None:
    p.add_argument("--teacher-dtype", default="fp32", choices=tuple(TEACHER_DTYPES),
                   help="dtype the frozen teacher is held and run in (bf16: half its memory; the distillation loss "
                        "is computed in fp32 either way)")
    p.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="with --fsdp on GPUs: FSDP2's CPU offload policy (shards and optimizer state in CPU memory, "
                        "each unit copied to the GPU for its forward / backward)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder block's activations in backward instead of keeping them (less "
                        "memory, about one more forward of time)")


def check_sharding_flags(args, device: str) -> None:
    """The combinations of the sharding flags, before anything loads."""
    from ..train.fsdp import check_cpu_offload

    if args.fsdp_cpu_offload and not args.fsdp:
        raise UsageError("--fsdp-cpu-offload is FSDP2's offload policy: add --fsdp (under torchrun)")
    check_cpu_offload(args.fsdp_cpu_offload, device)


MMAP_THRESHOLD = 1 << 20  # bytes: allocations from here up are mmapped, and unmapped when freed


def return_large_frees() -> bool:
    """glibc: serve every allocation of at least ``MMAP_THRESHOLD`` bytes by mmap, returned to the system when
    freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold after each large free).
    FSDP2 gathers and frees every unit's full tensors at each forward and backward; with the default dynamic
    threshold those blocks come from the heap, which keeps them: a 2-rank learn-scales of SmolLM2 peaked at
    2,518 MiB per rank that way and at 1,892 MiB with this (docs/results/scale.md). Returns False where it
    does not apply (not glibc)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD) == 1  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def teacher_dtype(args) -> torch.dtype:
    return TEACHER_DTYPES[args.teacher_dtype]


def why_not_sharded(model: str) -> Optional[str]:
    """Why ``model`` cannot be built shard by shard (``--fsdp``), or None (a local safetensors directory, a hub
    name's safetensors snapshot, a GGUF file of a per-tensor architecture, the built-in smollm2-135m)."""
    from ..models.hf_streaming import check_source, is_gguf

    if model.lower() == "stories260k":
        return "stories260k is not a transformers checkpoint"
    if model.lower() in ("smollm2-135m", "smollm2"):
        return None
    p = Path(model).expanduser()
    if not p.exists():
        return None if "/" in model and not model.startswith((".", "/", "~")) else f"{model} does not exist"
    if not p.is_dir() and not is_gguf(p):
        return f"{model} is neither a directory nor a .gguf file"
    try:
        check_source(p)
    except UsageError as e:
        return str(e).split(": ", 1)[-1]
    return None


def sharding_note(args, is_ckpt: bool, teacher_name: str) -> tuple[bool, bool, Optional[str]]:
    """(student built sharded?, teacher built sharded?, the one line a --fsdp run prints when a model is
    loaded whole on every rank instead)."""
    if not args.fsdp:
        return False, False, None
    why_s = None if is_ckpt else why_not_sharded(args.model)
    why_t = why_not_sharded(teacher_name)
    lines = [f"{name}: {why}" for name, why in ((args.model, why_s), (teacher_name, why_t)) if why]
    note = None
    if lines:
        note = ("--fsdp: " + "; ".join(dict.fromkeys(lines)) + "; loading it whole on every rank before sharding")
    return why_s is None, why_t is None, note


def sharding_options(args):
    from ..lsq.sharded_student import ShardingOptions

    return ShardingOptions(param_dtype=args.fsdp_param_dtype, cpu_offload=args.fsdp_cpu_offload,
                           activation_checkpointing=args.activation_checkpointing)


def sharded_teacher(teacher_name: str, args, device: str):
    """The teacher on the meta device, sharded, each rank's rows read from the checkpoint (collective)."""
    from ..models.hf_streaming import StreamingModel
    from ..train.fsdp_source import sharded_from_source
    from .quantize_streaming import streaming_source

    src = StreamingModel(streaming_source(teacher_name), teacher_dtype(args))
    model = sharded_from_source(src, args.fsdp_param_dtype, cpu_offload=args.fsdp_cpu_offload, device=device)
    return model, src.bytes_read


def streamed_student(args, cfg, defaults, recovery, progress: bool):
    """(student, tokenizer, PTQ report dict, dequantized names, bytes read) of a model-name input: the
    streamed, data-parallel PTQ initialisation sharding each layer as it is done (collective)."""
    from ..data.text_sources import calibration_batches
    from ..lsq.sharded_student import stream_sharded_student
    from ..models.hf import open_tokenizer
    from ..models.hf_streaming import is_gguf
    from .quantize_streaming import streaming_source

    src = streaming_source(args.model)
    tok = open_tokenizer(src.parent, gguf_file=src.name) if is_gguf(src) else open_tokenizer(src)
    if tok is None:
        raise UsageError(f"learn-scales trains on text, but {args.model} has no tokenizer (save one next to the "
                         "weights)")
    batches = None
    if cfg.needs_calibration:
        batches = calibration_batches(tok, defaults.calib, cfg.n_samples, cfg.seq_len, seed=cfg.seed,
                                      bos=defaults.calib_bos)
    built = stream_sharded_student(src, cfg, batches, recovery, sharding_options(args), progress=progress)
    report = built.report.to_dict()
    report["config"]["calibration_source"] = defaults.calib if batches is not None else None
    return built, tok, report


def sharded_checkpoint_student(student, recovery, args):
    """A quantized checkpoint student made trainable and sharded block by block (collective)."""
    from ..lsq.sharded_student import shard_enabled_student

    return shard_enabled_student(student, recovery, sharding_options(args))


__all__ = ["MMAP_THRESHOLD", "TEACHER_DTYPES", "return_large_frees", "add_sharding_flags", "check_sharding_flags", "sharded_checkpoint_student",
           "sharded_teacher", "sharding_note", "sharding_options", "streamed_student", "teacher_dtype",
           "why_not_sharded"]
