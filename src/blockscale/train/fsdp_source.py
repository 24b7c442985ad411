"""A transformers model sharded with FSDP2 straight from its checkpoint, never whole on any rank: built on the
meta device (``models.hf_streaming.StreamingModel``), ``fully_shard``-ed per decoder block and at the root
(``fsdp.shard_model``), given empty local storage (``to_empty``), and each rank fills its own rows of every
parameter from the checkpoint (``StreamingModel.read_rows``: a safetensors source reads only those rows'
bytes; a GGUF source dequantizes one tensor at a time and keeps its rows).

    src = StreamingModel("model_dir", torch.bfloat16)
    teacher = sharded_from_source(src, param_dtype="bf16")   # src.bytes_read: this rank's bytes

FSDP2 cuts a parameter of N rows into ``torch.chunk`` pieces: rank r holds rows ``[r c, min(N, (r + 1) c))``
with ``c = ceil(N / W)`` (``fsdp.local_rows``; a rank may hold none). Buffers are not sharded: the real ones
(non-persistent RoPE tables, initialised as ``from_pretrained`` does) are kept across ``to_empty``, and the
persistent ones read whole.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import CheckpointError
from .fsdp import shard_model
from .fsdp_meta import local_rows


def _meta_buffers(model: nn.Module) -> list[str]:
    return [n for n, b in model.named_buffers() if b.device.type == "meta"]


@torch.no_grad()
def fill_local_shards(model: nn.Module, read_rows, rank: int, world: int) -> int:
    """Copy into every sharded parameter of ``model`` (DTensors after ``to_empty``) this rank's rows,
    ``read_rows(name, start, stop)``; a plain parameter (not sharded) gets all its rows. Returns the number of
    parameters filled."""
    from torch.distributed.tensor import DTensor

    n = 0
    for name, p in model.named_parameters():  # (a tied parameter once)
        local = p.to_local() if isinstance(p, DTensor) else p.data
        start, stop = local_rows(p.shape[0], rank, world) if isinstance(p, DTensor) else (0, p.shape[0])
        if local.shape[0] != stop - start:
            raise RuntimeError(f"{name}: the local shard has {local.shape[0]} rows, expected rows [{start}, {stop}) "
                               f"of {p.shape[0]} (FSDP2 changed its sharding rule?)")
        if stop > start:
            rows = read_rows(name, start, stop)
            if tuple(rows.shape) != tuple(local.shape):
                raise CheckpointError(f"{name}: the checkpoint's rows [{start}, {stop}) have shape "
                                      f"{tuple(rows.shape)}, the model's {tuple(local.shape)}")
            local.copy_(rows)
        n += 1
    return n


def sharded_from_source(src, param_dtype: str = "fp32", cpu_offload: bool = False, device="cpu") -> nn.Module:
    """``src.model`` (a ``StreamingModel``'s meta model) sharded with ``shard_model`` and filled from the
    checkpoint with this rank's rows only (see the module docstring); returns the model (eval mode, every
    parameter frozen). Collective: every rank of the process group calls it."""
    import torch.distributed as dist

    model = src.model
    model.tie_weights()
    src.init_buffers()  # the non-persistent buffers (RoPE) real, as from_pretrained makes them
    for name in _meta_buffers(model):  # persistent buffers: read whole (small; none in most models)
        src.load([src.row_source(name)])
    kept = {n: b.detach().clone() for n, b in model.named_buffers()}
    for p in model.parameters():
        p.requires_grad_(False)
    shard_model(model, param_dtype, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    for name, b in kept.items():
        mod_name, _, leaf = name.rpartition(".")
        model.get_submodule(mod_name)._buffers[leaf] = b.to(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    fill_local_shards(model, src.read_rows, rank, world)
    src.close()
    model.eval()
    return model


__all__ = ["fill_local_shards", "sharded_from_source"]
