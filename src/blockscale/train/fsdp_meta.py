"""FSDP2 for a model built on the meta device: which rows of a parameter a rank holds, and each rank's shards
filled from the model's own initial values (``materialize_sharded``), so that no rank ever builds the whole
model. Re-exported by ``train.fsdp``."""
from __future__ import annotations

import torch
import torch.nn as nn

def local_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim-0 size ``rows`` that FSDP2 gives ``rank`` of ``world``."""
    chunk = -(-rows // world)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


@torch.no_grad()
def materialize_sharded(model: nn.Module, device="cpu") -> None:
    """A model built on the meta device and sharded (``shard_model``) given its initial values shard by shard:
    storage for this rank's shards (``to_empty``), each parameter's rows copied from ``model.initial_values()``
    ((name, full tensor) one at a time: one tensor beyond the shards at any moment) and its derived buffers
    from ``model.reset_buffers(device)``. A model without those methods is a ValueError naming them."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not (callable(getattr(model, "initial_values", None)) and callable(getattr(model, "reset_buffers", None))):
        raise ValueError(f"{type(model).__name__} was built on the meta device but has no initial_values() / "
                         "reset_buffers() to fill its shards from; build it on a real device")
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    done = set()
    for name, full in model.initial_values():
        p = params[name]
        local = p.to_local() if isinstance(p, DTensor) else p.data
        start, stop = local_rows(p.shape[0], rank, world) if isinstance(p, DTensor) else (0, p.shape[0])
        local.copy_(full[start:stop])
        done.add(name)
    if set(params) - done:
        raise ValueError(f"{type(model).__name__}.initial_values() gave no value for {sorted(set(params) - done)[:3]}")
    model.reset_buffers(device)


__all__ = ["has_meta_parameters", "local_rows", "materialize_sharded"]
