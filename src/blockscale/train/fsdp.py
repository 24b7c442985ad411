"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the one training loop: sharding per decoder block,
mixed-precision policies, sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and the
way back to a plain model at the end of a run.

    shard_model(model, param_dtype="bf16", fp32_units=learners)   # units: learners, blocks, root
    ... train ...
    save_sharded(run / "ckpt.dcp", model, optimizer, meta, info)  # every rank writes its shards
    unshard_model(model)                                           # plain full tensors on every rank again

Units (innermost first): under a lower ``param_dtype``, each module of ``fp32_units`` (the LSQ learners:
latent weight + block amaxes) with an FP32 policy; then every child of the outermost ``nn.ModuleList``s (the
decoder blocks), then the root; each with ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``
("fp32": no casts at all, and the ``fp32_units`` are part of their blocks' units: a learner's forward takes
no tensor input, so FSDP2 has nothing to hang its post-backward hook on and would keep every learner
gathered from its backward to the end of the whole backward, the model's latent weights in full on each
rank). FSDP2 shards every parameter along dim 0 (padding the last rank when the rows
do not divide); buffers (packed FP4 codes, E4M3 scales, outer scales) stay whole on every rank. In
forward a unit's parameters are all-gathered, so whatever runs inside (a recipe's quantizer, the LSQ
fake-quantizer) sees the full tensor, e.g. the NVFP4 outer scale comes from the full weight's amax.

Sharded checkpoints (``save_sharded`` / ``load_sharded``): a directory ``NAME.dcp`` written as
``NAME.dcp.tmp`` by ``dcp.save`` (each rank its shards) plus ``meta.pt`` (step, config, RNG, ... by rank
0), then renamed into place by rank 0 after a barrier: it appears only when complete.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import UsageError
from .checkpoint import TrainingCheckpointError, load_weights_only, save_atomic
from .distributed import DistInfo, barrier
from .fsdp_meta import has_meta_parameters, local_rows, materialize_sharded  # noqa: F401  (re-exported)

FSDP_PARAM_DTYPES = ("fp32", "bf16")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: FSDP keeps the parameters' own dtype (no casts)
META_NAME = "meta.pt"


def check_fsdp_options(fsdp, param_dtype, owner: str = "config") -> None:
    """UsageError naming the field unless ``fsdp`` is a bool and ``param_dtype`` one of FSDP_PARAM_DTYPES."""
    if not isinstance(fsdp, bool):
        raise UsageError(f"{owner}.fsdp={fsdp!r}: expected True or False")
    if param_dtype not in FSDP_PARAM_DTYPES:
        raise UsageError(f"{owner}.fsdp_param_dtype={param_dtype!r}; allowed values: "
                         f"{', '.join(map(repr, FSDP_PARAM_DTYPES))}")


def require_distributed(info: DistInfo, what: str = "--fsdp") -> None:
    """FSDP shards over ranks: one process has nothing to shard over, so refuse instead of silently
    running unsharded."""
    if not info.enabled:
        raise UsageError(f"{what} needs a torchrun job with at least 2 processes (e.g. torchrun --nproc_per_node 2 "
                         "-m blockscale.cli ...); without torchrun drop --fsdp")


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The children of every outermost ``nn.ModuleList`` of ``model`` (the decoder blocks: ``layers``;
    expert lists nested inside a block stay in their block)."""
    blocks, inside = [], set()
    for _, m in model.named_modules():
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            blocks.extend(m)
            inside.update(id(s) for s in m.modules())
    return blocks


def outer_units(model: nn.Module) -> list[nn.Module]:
    """The embeddings and Linears outside the decoder blocks (token embeddings, the head) whose parameters no
    other module shares: units of their own, so each is gathered whole only around its own forward and
    backward (in the root unit the root keeps them gathered from its forward to the end of backward). A
    tied embedding / head stays in the root."""
    inside = {id(m) for b in block_modules(model) for m in b.modules()}
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in model.modules() if m is not model and id(m) not in inside
            and isinstance(m, (nn.Embedding, nn.Linear)) and all(owners[id(p)] == 1 for p in m.parameters())]


def _policy(param_dtype: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=torch.float32)


def _shard_kwargs(param_dtype: str, cpu_offload: bool) -> dict:
    kwargs = {"mp_policy": _policy(param_dtype)}
    if cpu_offload:  # the shards (and their optimizer state) live in CPU memory, copied to the GPU per unit
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def check_cpu_offload(cpu_offload: bool, device, what: str = "--fsdp-cpu-offload") -> None:
    """UsageError unless ``cpu_offload`` is off or the run computes on an accelerator (FSDP2's
    CPUOffloadPolicy copies each unit's CPU shards to the accelerator for its forward / backward; on a CPU
    run the shards are in CPU memory already and torch refuses the policy)."""
    if cpu_offload and torch.device(device).type == "cpu":
        raise UsageError(f"{what} keeps the FSDP shards in CPU memory and computes on the GPU: it needs --device "
                         "cuda (on a CPU run the shards are in CPU memory already; drop the flag)")


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing of every decoder block (``block_modules``) with torch's composable
    ``checkpoint`` (non-reentrant; parameter names unchanged, composes with ``fully_shard``): a block's
    activations are recomputed in backward instead of kept. Returns the number of blocks."""
    from torch.distributed._composable import checkpoint

    blocks = block_modules(model)
    for block in blocks:
        checkpoint(block)
    return len(blocks)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (its root) has been ``fully_shard``-ed already."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def own_units(fp32_units: Iterable[nn.Module], param_dtype: str) -> list[nn.Module]:
    """The ``fp32_units`` that need FSDP units of their own: all of them under a lower ``param_dtype`` (to keep
    them FP32), none under "fp32" (their block's unit is FP32 already). A unit of its own would cost memory
    there: the LSQ learners' forward takes no tensor input, so FSDP2 registers no post-backward hook for them
    and reshards them only when the whole backward ends (every learner's latent weight gathered at once)."""
    return [] if param_dtype == "fp32" else list(fp32_units)


def shard_block(block: nn.Module, param_dtype: str = "fp32", fp32_units: Iterable[nn.Module] = (),
                cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` one decoder block: each of its ``fp32_units`` (FP32 policy; only under a lower
    ``param_dtype``: ``own_units``), then the block."""
    from torch.distributed.fsdp import fully_shard

    for unit in own_units(fp32_units, param_dtype):
        fully_shard(unit, **_shard_kwargs("fp32", cpu_offload))
    fully_shard(block, **_shard_kwargs(param_dtype, cpu_offload))
    return block


def shard_model(model: nn.Module, param_dtype: str = "fp32", fp32_units: Iterable[nn.Module] = (), *,
                cpu_offload: bool = False, blocks: bool = True) -> nn.Module:
    """``fully_shard`` ``model`` in place (a process group must be initialized): each of ``fp32_units``
    (FP32 policy; only under a lower ``param_dtype``: ``own_units``), each decoder block (``block_modules``; ``blocks=False``: they were sharded already, e.g.
    one by one as they were built), the untied embeddings / head (``outer_units``), then the root; returns
    ``model``. A model sharded already is returned
    as it is. ``cpu_offload``: FSDP2's ``CPUOffloadPolicy`` on every unit (needs an accelerator)."""
    from torch.distributed.fsdp import fully_shard

    if param_dtype not in FSDP_PARAM_DTYPES:
        raise UsageError(f"fsdp_param_dtype={param_dtype!r}; allowed values: {', '.join(FSDP_PARAM_DTYPES)}")
    if is_sharded(model):
        return model
    for unit in own_units(fp32_units, param_dtype):
        fully_shard(unit, **_shard_kwargs("fp32", cpu_offload))
    for block in block_modules(model) if blocks else ():
        fully_shard(block, **_shard_kwargs(param_dtype, cpu_offload))
    for unit in outer_units(model):
        fully_shard(unit, **_shard_kwargs(param_dtype, cpu_offload))
    fully_shard(model, **_shard_kwargs(param_dtype, cpu_offload))
    return model


def unshard_model(model: nn.Module) -> nn.Module:
    """Undo ``shard_model`` (collective: every rank calls it): every sharded parameter is replaced by a
    plain ``nn.Parameter`` holding the full tensor (``DTensor.full_tensor``; tied parameters stay tied,
    requires_grad kept), FSDP's hooks are removed and each module gets its own class back, so the model
    is the plain module it was (what freeze / export / evaluation after a run need)."""
    _unshard(model, _units(model), {})
    return model


def unshard_blockwise(model: nn.Module, on_block: Optional[Callable[[nn.Module], None]] = None,
                      keep: bool = True) -> nn.Module:
    """``unshard_model`` one decoder block at a time (collective), so that a rank never holds more than one
    block's full tensors beyond what it keeps: each block (``block_modules``) is gathered into plain full
    parameters, ``on_block(block)`` runs (e.g. ``lsq.freeze`` of its layers: the latent FP32 weights become
    packed codes before the next block is gathered), and with ``keep=False`` (the ranks that do not write
    the result) its tensors are released to the meta device; then the root's own parameters (embeddings,
    final norm, head) the same way."""
    import gc
    import weakref

    from ..models.hf_streaming import release, trim_heap

    # id -> full Parameter, held weakly: a tie between a block and the root is found while the block keeps
    # its parameter, and a block's full tensors go as soon as it drops them (frozen to codes, or released)
    done: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
    for block in block_modules(model):
        _unshard(block, _units(block), done)
        if on_block is not None:
            on_block(block)
        if not keep:
            release(block)
        gc.collect()  # a dropped unit and its former FSDP state refer to each other: free its tensors now
        trim_heap()
    _unshard(model, _units(model), done)
    if not keep:
        release(model)
    return model


def _units(root: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def _unshard(root: nn.Module, units: list, full: dict) -> None:
    """The parameters under ``root`` gathered into plain full ones (``full``: id -> the new Parameter, so a
    tied parameter stays one), then ``units`` stripped of FSDP (hooks, state, class)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not units:
        return
    for m in units:
        m.reshard()
    with torch.no_grad():
        for m in root.modules():
            for name, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    q = full.get(id(p))  # (a strong reference before the module holds it: ``full`` may be weak)
                    if q is None:
                        q = full[id(p)] = nn.Parameter(p.full_tensor().detach().clone(),
                                                       requires_grad=p.requires_grad)
                    m._parameters[name] = q
    for m in units:
        state = m._get_fsdp_state()
        for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
            handle.remove()
        for group in state._fsdp_param_groups:
            for handles in (group._module_to_pre_save_state_dict_hook_handle,
                            group._module_to_pre_load_state_dict_hook_handle):
                for h in handles.values():
                    h.remove()
        # the root's FSDP state lists every unit's state, whose parameter records refer to the modules that
        # own the parameters (and to this rank's shards): without this, a block's modules dropped after it is gathered (an LSQ learner
        # frozen to codes) would live, with their full tensors, until the root is gathered last
        for group in state._fsdp_param_groups:
            group.fsdp_params = []  # (also this rank's shards, replaced by the full tensors above)
        state._fsdp_param_groups = []
        m.__class__ = next(c for c in type(m).__mro__[1:] if not issubclass(c, FSDPModule))
        for key in (STATE_KEY, REGISTRY_KEY):
            m.__dict__.pop(key, None)
    for m in root.modules():
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            m.__dict__.pop(attr, None)


# ----------------------------------------------------------------------------- sharded checkpoints

def dcp_dir(ckpt_path: Path) -> Path:
    """The sharded checkpoint directory of a run's ``ckpt_path`` (``ckpt.pt`` -> ``ckpt.dcp``)."""
    return ckpt_path.with_name(ckpt_path.stem + ".dcp")


def _state(model: nn.Module, optimizer, trainable_only: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    if trainable_only:
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in keep}
    return {"model": msd, "optimizer": osd}


def save_sharded(path: Path, model: nn.Module, optimizer, meta: dict, info: DistInfo,
                 trainable_only: bool = False) -> Path:
    """Write the sharded checkpoint directory ``path`` atomically (collective): ``dcp.save`` of the model
    (``trainable_only``: the parameters with requires_grad only) and optimizer state into ``path.tmp``,
    rank 0's ``meta`` as ``meta.pt``, then rank 0 swaps it into place (an older ``path`` is replaced only
    once the new one is complete)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    dcp.save(_state(model, optimizer, trainable_only), checkpoint_id=str(tmp))
    if info.is_main:
        save_atomic(tmp / META_NAME, meta)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return path


def read_sharded_meta(path: Path) -> dict:
    """``meta.pt`` of a sharded checkpoint directory (``load_weights_only``: TrainingCheckpointError when bad)."""
    meta = Path(path) / META_NAME
    if not meta.is_file():
        raise TrainingCheckpointError(f"{path} is not a complete sharded checkpoint (no {META_NAME})")
    return load_weights_only(meta)


def load_sharded(path: Path, model: nn.Module, optimizer, trainable_only: bool = False) -> None:
    """Load a ``save_sharded`` directory into the sharded ``model`` and its ``optimizer`` in place
    (collective); TrainingCheckpointError when it does not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(model, optimizer, trainable_only)
    try:
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=not trainable_only))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainingCheckpointError(f"sharded checkpoint {path} does not fit this model / optimizer: "
                                      f"{str(exc)[:400]}") from exc


def run_meta(contents, step: int, config: dict, info: DistInfo, elapsed_s: float, record: Optional[dict]) -> dict:
    """``meta.pt`` of a sharded checkpoint: what a ``torch.save`` checkpoint holds besides the tensors
    (step, config, world size, elapsed time, run record and, for whole-model contents, the torch RNG)."""
    meta = {"format": contents.format, "step": int(step), "config": config, "world_size": info.world_size,
            "elapsed_s": float(elapsed_s), "sharded": True}
    if not contents.trainable_only:
        meta["rng"] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            meta["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    if record is not None:
        meta["record"] = record
    return meta


def prepare_fsdp(model: nn.Module, task, loop, info: DistInfo, ckpt_path: Optional[Path], resume: bool,
                 device="cpu"):
    """The loop's FSDP set-up: shard ``model`` (``task.fsdp_units(model)``, if the task has it, get their
    own FP32 units; a model built on the meta device then gets its shards' initial values:
    ``materialize_sharded``), the optimizer over the sharded parameters and, with ``resume``,
    the sharded checkpoint loaded into both. Returns (meta or None, optimizer, trainable params, checkpoint
    dir)."""
    require_distributed(info)
    units = task.fsdp_units(model) if hasattr(task, "fsdp_units") else []
    shard_model(model, loop.fsdp_param_dtype, units, cpu_offload=loop.fsdp_cpu_offload)
    if has_meta_parameters(model):  # built on the meta device: each rank fills its own shards
        materialize_sharded(model, device)
    params = task.trainable(model)  # the sharded parameters now
    optimizer = task.make_optimizer(model)
    path = dcp_dir(ckpt_path) if ckpt_path is not None else None
    meta = None
    if resume and path.exists():
        meta = read_sharded_meta(path)
        if not isinstance(meta, dict) or meta.get("format") != task.contents.format or "step" not in meta:
            raise TrainingCheckpointError(f"{path} is not a sharded {task.contents.format} checkpoint")
        load_sharded(path, model, optimizer, task.contents.trainable_only)
    elif resume and ckpt_path.exists():
        raise TrainingCheckpointError(f"{ckpt_path} was written without --fsdp (there is no sharded checkpoint "
                                      f"{path.name}): resume it without --fsdp, or start a new run in another directory")
    return meta, optimizer, params, path


def clip_sharded(params, max_norm: float) -> torch.Tensor:
    """``clip_gradients`` for FSDP-sharded gradients (DTensors): the global L2 norm from the local shards'
    squares summed over ranks, and torch's clip_grad_norm_ rule (scale by min(1, max_norm / (norm +
    1e-6))); 0 disables clipping. Returns the norm before clipping (a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if any(not isinstance(g, DTensor) for g in grads):
        raise RuntimeError("clip_sharded: a trainable parameter is not sharded by FSDP")
    local = [g.to_local() for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.detach().float().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.detach().mul_(coef.to(g.dtype))
    return norm


def local_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's tensors held by this process (a sharded state counts its local shard)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        DTensor = ()
    total = 0
    for s in optimizer.state.values():
        for v in s.values():
            v = v.to_local() if isinstance(v, DTensor) else v
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def plain_optimizer_state(full: dict, optimizer, model: nn.Module) -> dict:
    """The full FQN-keyed optimizer state dict of ``get_optimizer_state_dict(full_state_dict=True)`` in
    torch's own layout (parameters numbered in param-group order), as ``optimizer.state_dict()`` of an
    unsharded run holds it (what ``restore_optimizer`` and a run without --fsdp resume from)."""
    names = {id(p): n for n, p in model.named_parameters()}
    index, groups = {}, []
    for group, saved in zip(optimizer.param_groups, full["param_groups"]):
        ids = []
        for p in group["params"]:
            index[names[id(p)]] = len(index)
            ids.append(index[names[id(p)]])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


class _SavedOptimizer:
    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def finish_fsdp(model: nn.Module, optimizer, contents, ckpt_path: Optional[Path], info: DistInfo, fields: dict,
                keep_sharded: bool = False) -> None:
    """End of an FSDP run (collective): ``unshard_model`` and, if ``ckpt_path``, the final checkpoint as a
    run without --fsdp writes it (whole model / trainable tensors and the optimizer, gathered on rank 0,
    ``contents.save``); ``fields``: step, config and the extra keys. ``keep_sharded`` (a trainable-only
    task whose caller gathers the model block by block: ``unshard_blockwise``): the model stays sharded and
    only its trainable tensors are gathered for the checkpoint."""
    osd, tensors = None, None
    if keep_sharded and not contents.trainable_only:
        raise ValueError("finish_fsdp(keep_sharded=True) needs a trainable-only checkpoint")
    if ckpt_path is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
        if info.is_main:
            osd = plain_optimizer_state(full, optimizer, model)
        if keep_sharded:
            tensors = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    if not keep_sharded:
        unshard_model(model)
    if ckpt_path is not None and info.is_main:
        fields = dict(fields)
        contents.save(ckpt_path, model, _SavedOptimizer(osd), fields.pop("step"), fields.pop("config"),
                      trainable=tensors, **fields)
    barrier(info)


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()


__all__ = ["FSDP_PARAM_DTYPES", "block_modules", "own_units", "check_fsdp_options", "clip_sharded", "dcp_dir", "finish_fsdp",
           "load_sharded", "local_state_bytes", "plain_optimizer_state", "prepare_fsdp", "read_sharded_meta",
           "require_distributed", "run_meta", "save_sharded", "shard_block", "shard_model", "unshard_blockwise",
           "unshard_model", "check_cpu_offload", "checkpoint_blocks", "has_meta_parameters", "is_sharded",
           "local_rows", "materialize_sharded", "outer_units"]
