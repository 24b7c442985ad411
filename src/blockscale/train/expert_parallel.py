"""Expert parallelism in the training loop (``train(..., expert_parallel=CommConfig(...))``,
``blockscale train --expert-parallel``), combined with data parallelism over the same W ranks:

- every ``MoE`` becomes an ``ExpertParallelMoE`` (``nn.moe_parallel.to_expert_parallel``): rank r keeps
  experts r*E/W .. (r+1)*E/W - 1; tokens travel to them and back by all-to-alls in the ``CommConfig``
  payloads, on a process group of their own (so they never interleave with DDP's all-reduces);
- the other parameters are DDP-replicated; DDP ignores the experts, whose gradients already sum every
  rank's tokens and are divided by W after the last micro step (``sync_expert_parallel_grads``'s rule);
- the load-balancing loss is formed over the global batch (``global_load_balancing_loss``);
- gradient clipping uses the global norm: the replicated part plus the all-reduced squares of every
  rank's experts, so every rank scales by the same factor;
- checkpoints hold the FULL model: each expert tensor (and its AdamW moments) is gathered from the
  ranks and concatenated in expert order, so ``ckpt.pt`` has the single-process layout
  (``blockscale to-hf``, evaluation and plain loading work on it); a resumed run slices its own experts
  back out, so any world size dividing E resumes it.

One process (W = 1): the layer keeps all experts and emulates the payloads; that run is the
single-process reference the W-rank run is tested against (``tests/train/test_train_expert_parallel.py``).
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError, UsageError
from ..nn.moe import MoE
from ..nn.moe_parallel import (CommConfig, ExpertParallelMoE, check_expert_split, expert_parameter_names,
                                to_expert_parallel)
from .distributed import DistInfo
from .gradients import clip_gradients


class _StateOf:
    """A stand-in with ``state_dict()`` (what ``CheckpointContents.save`` calls) returning a fixed dict."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def comm_record(comm: CommConfig) -> dict:
    """The run record entry of an expert-parallel run (payloads and Hadamard seed)."""
    if not isinstance(comm, CommConfig):
        raise UsageError(f"expert_parallel must be a blockscale.nn.moe_parallel.CommConfig, got {type(comm).__name__}")
    return asdict(comm)


class ExpertParallelRun:
    """What the loop does differently under expert parallelism (see the module docstring)."""

    def __init__(self, comm: CommConfig, info: DistInfo):
        if not isinstance(comm, CommConfig):
            raise UsageError(f"expert_parallel must be a blockscale.nn.moe_parallel.CommConfig, got "
                             f"{type(comm).__name__}")
        self.comm, self.info = comm, info
        self.group = None
        self.names: list[str] = []
        self.split: dict[str, tuple[int, int, int]] = {}  # name -> (first, n_local, n_experts)

    def apply(self, model: nn.Module) -> None:
        """Shard the experts of ``model`` (in place; before it moves to its device and DDP wraps it)."""
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        if any(isinstance(m, ExpertParallelMoE) for m in model.modules()):
            raise UsageError("the model is expert-parallel already (a model trained with expert_parallel keeps this "
                             "rank's experts only): build a fresh model, or load the full checkpoint into one")
        if not moes:
            raise UsageError("expert parallelism needs a model with MoE layers (e.g. --model-preset tiny-moe or "
                             "small-moe); this one has none")
        for m in moes:
            try:
                check_expert_split(m.experts.n_experts, self.info.world_size)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if self.info.enabled:
            self.group = dist.new_group()  # every rank calls it, in the same order
        to_expert_parallel(model, self.comm, self.group, global_aux=True)
        self.names = sorted(expert_parameter_names(model))
        for name in self.names:
            experts = model.get_submodule(name.rpartition(".")[0])
            self.split[name] = (experts.first_expert, experts.n_local, experts.n_experts)

    def ddp_ignored(self) -> list[str]:
        return list(self.names)

    def _expert_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(model.named_parameters())
        return {n: params[n] for n in self.names}

    @torch.no_grad()
    def finish_grads(self, model: nn.Module) -> None:
        """After the last micro step's backward: experts' gradients / W (the mean-over-ranks loss)."""
        if not self.info.enabled:
            return
        for p in self._expert_params(model).values():
            if p.grad is not None:
                p.grad.div_(self.info.world_size)

    @torch.no_grad()
    def clip(self, model: nn.Module, params, max_norm: float) -> torch.Tensor:
        """``clip_gradients`` with the norm over the whole model (replicated parameters once, every rank's
        experts); one process: ``clip_gradients`` itself."""
        params = list(params)
        if not self.info.enabled:
            return clip_gradients(params, max_norm)
        experts = {id(p) for p in self._expert_params(model).values()}
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        rep, exp = torch.zeros((), device=device), torch.zeros((), device=device)
        for p in params:
            if p.grad is not None:
                n2 = torch.linalg.vector_norm(p.grad.float()).square()
                if id(p) in experts:
                    exp += n2
                else:
                    rep += n2
        dist.all_reduce(exp, group=self.group)
        total = (rep + exp).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ checkpoints

    @staticmethod
    def _optimizer_index(optimizer) -> dict[int, int]:
        """id(parameter) -> its key in ``optimizer.state_dict()["state"]`` (torch numbers the parameters of
        the groups in order)."""
        out, i = {}, 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                out[id(p)] = i
                i += 1
        return out

    def _expert_slots(self, model, optimizer) -> list[tuple[str, int]]:
        index = self._optimizer_index(optimizer)
        return [(n, index[id(p)]) for n, p in self._expert_params(model).items() if id(p) in index]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if not self.info.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.info.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def gathered(self, model: nn.Module, optimizer) -> tuple[object, object]:
        """(model, optimizer) stand-ins whose ``state_dict()`` is the full single-process layout: every rank
        must call this (the experts are all-gathered); rank 0 saves the result."""
        model_state = model.state_dict()
        opt_state = optimizer.state_dict()
        if not self.info.enabled:
            return _StateOf(model_state), _StateOf(opt_state)
        for name in self.names:
            model_state[name] = self._gather(model_state[name].detach())
        state = dict(opt_state["state"])
        for name, i in self._expert_slots(model, optimizer):
            n_local = self.split[name][1]
            if i in state:
                state[i] = {k: self._gather(v) if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n_local else v
                            for k, v in sorted(state[i].items())}
        return _StateOf(model_state), _StateOf({**opt_state, "state": state})

    def _slice(self, name: str, t: torch.Tensor, where: str, path) -> torch.Tensor:
        first, n_local, n_experts = self.split[name]
        if t.dim() == 0 or t.shape[0] != n_experts:
            raise CheckpointError(f"checkpoint {path}: {where} {name} has shape {tuple(t.shape)}; expected the "
                                  f"{n_experts} experts of the full model first")
        return t[first:first + n_local].clone()

    def local_model_state(self, state: dict, path) -> dict:
        """A checkpoint's full model state with this rank's experts sliced out (before restore_model)."""
        model = dict(state["model"])
        for name in self.names:
            if name in model:
                model[name] = self._slice(name, model[name], "tensor", path)
        return {**state, "model": model}

    def local_optimizer_state(self, state: dict, model: nn.Module, optimizer, path) -> dict:
        """The same for the optimizer state (before restore_optimizer; needs the optimizer's numbering)."""
        opt = state["optimizer"]
        moments = dict(opt.get("state", {}))
        for name, i in self._expert_slots(model, optimizer):
            n_experts = self.split[name][2]
            if i in moments:
                moments[i] = {k: self._slice(name, v, f"optimizer state {k!r} of", path)
                              if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n_experts else v
                              for k, v in moments[i].items()}
        return {**state, "optimizer": {**opt, "state": moments}}


__all__ = ["ExpertParallelRun", "comm_record"]
