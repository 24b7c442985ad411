"""``blockscale train --expert-parallel`` flags: the MoE experts sharded over the torchrun ranks
(``train.expert_parallel``), the all-to-all payloads of ``nn.moe_parallel.CommConfig``.

    torchrun --nproc_per_node 2 -m blockscale.train --data tinystories --model-preset small-moe \\
        --expert-parallel --dispatch nvfp4 --combine s2f6 --out runs/ep
"""
from __future__ import annotations

import argparse
from typing import Optional

from ..errors import UsageError
from ..models.llama import PRESETS
from ..nn.moe_parallel import COMBINE_PAYLOADS, DISPATCH_PAYLOADS, GRAD_PAYLOADS, CommConfig
from ..train.distributed import env_world

_PAYLOAD_FLAGS = (("dispatch", DISPATCH_PAYLOADS, "tokens -> experts"),
                  ("combine", COMBINE_PAYLOADS, "expert outputs -> tokens"),
                  ("dispatch_grad", GRAD_PAYLOADS, "the dispatch's gradient (backward)"),
                  ("combine_grad", GRAD_PAYLOADS, "the combine's gradient (backward)"))


def add_expert_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-parallel", action="store_true",
                   help="shard the MoE experts over the torchrun ranks (data parallel for the rest; load-balancing "
                        "loss over the global batch; docs/moe.md)")
    for name, allowed, what in _PAYLOAD_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       metavar="{" + ",".join(allowed) + "}",
                       help=f"--expert-parallel payload of {what} (default bf16)")


def expert_parallel_config(args, cfg) -> Optional[CommConfig]:
    """The CommConfig of the flags (None without --expert-parallel); a bad combination is a UsageError
    naming the flag: payloads without --expert-parallel, a dense --model-preset, with --fsdp, or a
    world size that does not divide the number of experts."""
    given = [n for n, _, _ in _PAYLOAD_FLAGS if getattr(args, n) is not None]
    if not args.expert_parallel:
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --expert-parallel")
        return None
    for name, allowed, _ in _PAYLOAD_FLAGS:
        value = getattr(args, name)
        if value is not None and value not in allowed:
            raise UsageError(f"--{name.replace('_', '-')} {value}: expected one of {', '.join(allowed)}")
    if getattr(cfg, "fsdp", False):
        raise UsageError("--expert-parallel cannot be combined with --fsdp (expert parallelism runs with DDP)")
    moe = PRESETS[args.model_preset].moe
    if moe is None:
        moes = ", ".join(n for n, c in PRESETS.items() if c.moe is not None)
        raise UsageError(f"--expert-parallel needs an MoE model: --model-preset {args.model_preset} is dense "
                         f"(MoE presets: {moes})")
    world = env_world()[1]
    if moe.n_experts % world:
        raise UsageError(f"--expert-parallel: --model-preset {args.model_preset} has n_experts={moe.n_experts}, not "
                         f"divisible by the world size {world} (every rank holds the same number of experts; run "
                         f"a number of processes that divides {moe.n_experts})")
    return CommConfig(**{n: getattr(args, n) or "bf16" for n, _, _ in _PAYLOAD_FLAGS})


__all__ = ["add_expert_parallel_flags", "expert_parallel_config"]
