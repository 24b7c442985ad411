"""The --rotate flags: ``quantize --rotate`` and ``learn-scales --rotate`` checked before anything loads."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

ROTATE_METAVAR = "{none,r4,r1r2,r1r2r4,r3,r1r2r3r4,quip,block:N,mr}"


def check_rotate(text: str):
    """The ``RotationPlan`` of a --rotate value (``ptq.rotations.parse_rotate``); a UsageError naming the allowed
    values otherwise."""
    from ..ptq.rotations.plan import parse_rotate

    try:
        return parse_rotate(text)
    except UsageError as e:
        raise UsageError(f"--rotate: {e}") from None


def _online_rotations_in(model: str) -> bool:
    """Whether checkpoint directory ``model`` declares online transforms (compressed-tensors transform_config)."""
    import json

    cfg = Path(model) / "config.json"
    try:
        qcfg = json.loads(cfg.read_text()).get("quantization_config") or {}
        return bool((qcfg.get("transform_config") or {}).get("config_groups"))
    except (OSError, ValueError, AttributeError):
        return False  # (the loader names what is wrong with it)


def check_learn_scales_rotation(args) -> None:
    """--rotate parses; online rotations (asked for, or in the input checkpoint) need a format that holds them."""
    from ..export.registry import format_named

    if Path(args.model).is_dir() and _online_rotations_in(args.model) and format_named(args.format).transforms is None:
        raise UsageError(f"{args.model} rotates Linear inputs or keys online (transform_config), which {args.format} "
                         "checkpoints cannot hold: --format compressed-tensors")
    if args.rotate:
        plan = check_rotate(args.rotate)
        if plan.online and format_named(args.format).transforms is None:
            raise UsageError(f"--rotate {args.rotate} rotates Linear inputs or keys online, which {args.format} checkpoints "
                             "cannot hold: --format compressed-tensors, or fused rotations only (--rotate r1r2)")
