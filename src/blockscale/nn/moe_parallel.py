"""Expert parallelism: the experts of an ``MoE`` sharded over the ranks of a process group, tokens
sent to them and back with ``all_to_all_single`` as real bytes in a chosen wire format.

On each rank (W ranks, E experts, E/W local experts ``rank*E/W ..``):

    plan, aux   = router(x)                              local tokens, replicated router
    x_sorted    = x[plan.token]                          grouped by expert, so by owning rank
    x_recv      = all_to_all(encode(x_sorted, dispatch)) rows from rank 0, 1, ..; decode
    y           = experts(x_recv regrouped by local expert)
    y_sorted    = all_to_all(encode(y, combine))         back to the tokens' ranks; decode
    out         = index_add(weight * y_sorted) [+ shared_expert(x)]

Payloads (``quant.transforms.wire``): dispatch bf16 | nvfp4 (per-token outer scale); combine bf16 | mxfp8 |
s2f6 (32-point random Hadamard + S2F6, UE8M0 scales); the backward's all-to-alls carry gradients
in bf16 | mxfp8 (``dispatch_grad`` travels expert ranks -> token ranks, ``combine_grad`` the other
way). Counts per expert travel first (int64, W*E/W values per rank).

Without an initialized process group (or with W = 1) the same module runs in one process and the
payloads are emulated with ``quant.transforms.wire.emulate`` (the value ``decode(encode(x))`` has, bit for
bit): that is the single-process reference the expert-parallel layer is tested against. Rows reach
each expert in the same order as in one process running the ranks' batches concatenated (rank 0's
tokens first), so results are equal bit for bit there, not only to rounding.

Training: the router and shared expert are replicated (average their gradients over ranks, as data
parallel does); each expert's gradient already sums the contributions of every rank's tokens, so
divide it by W for the mean-over-ranks loss: ``sync_expert_parallel_grads``. The load-balancing
loss is computed per rank on its own tokens, or (``global_aux=True``, what ``blockscale train
--expert-parallel`` uses) over the global batch: ``global_load_balancing_loss``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..quant.transforms.wire import WIRE_PAYLOADS, decode_rows, emulate, encode_rows, row_bytes
from .moe import GroupedExperts, MoE, combine, dispatch

DISPATCH_PAYLOADS = ("bf16", "nvfp4")
COMBINE_PAYLOADS = ("bf16", "mxfp8", "s2f6")
GRAD_PAYLOADS = ("bf16", "mxfp8")
assert set(DISPATCH_PAYLOADS + COMBINE_PAYLOADS + GRAD_PAYLOADS) <= set(WIRE_PAYLOADS)


@dataclass(frozen=True)
class CommConfig:
    """Wire formats of the four all-to-alls of an expert-parallel MoE layer (seed: Hadamard signs)."""

    dispatch: str = "bf16"
    combine: str = "bf16"
    dispatch_grad: str = "bf16"
    combine_grad: str = "bf16"
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("dispatch", DISPATCH_PAYLOADS), ("combine", COMBINE_PAYLOADS),
                              ("dispatch_grad", GRAD_PAYLOADS), ("combine_grad", GRAD_PAYLOADS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"CommConfig.{name}={getattr(self, name)!r}; allowed values: "
                                 f"{', '.join(map(repr, allowed))}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"CommConfig.seed={self.seed!r}: expected an int")


@dataclass
class WireStats:
    """Bytes this rank sent to other ranks (rows for its own experts never leave it) and token rows,
    per all-to-all: keys dispatch, combine, dispatch_grad, combine_grad."""

    bytes: dict = field(default_factory=lambda: dict.fromkeys(("dispatch", "combine", "dispatch_grad",
                                                               "combine_grad"), 0))
    rows: dict = field(default_factory=lambda: dict.fromkeys(("dispatch", "combine", "dispatch_grad",
                                                              "combine_grad"), 0))

    def add(self, key: str, n_rows: int, n_bytes: int) -> None:
        self.rows[key] += n_rows
        self.bytes[key] += n_bytes

    def reset(self) -> None:
        for d in (self.bytes, self.rows):
            for k in d:
                d[k] = 0


def _all_to_all_bytes(buf: Tensor, send: list, recv: list, group) -> Tensor:
    out = buf.new_empty((sum(recv), buf.shape[1]))
    dist.all_to_all_single(out, buf.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Rows of x [sum(send), d] -> [sum(recv), d]: send[r] rows to rank r, encoded as ``payload``;
    the backward sends the gradient back the same way, encoded as ``grad_payload``."""

    @staticmethod
    def forward(ctx, x, send, recv, payload, grad_payload, keys, seed, group, stats, rank):
        ctx.args = (send, recv, grad_payload, keys[1], seed, group, stats, rank, x.dtype)
        d = x.shape[1]
        out = _all_to_all_bytes(encode_rows(x.detach(), payload, seed=seed), send, recv, group)
        if stats is not None:
            n = sum(send) - send[rank]
            stats.add(keys[0], n, n * row_bytes(payload, d))
        return decode_rows(out, payload, d, seed=seed).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        send, recv, payload, key, seed, group, stats, rank, dtype = ctx.args
        d = g.shape[1]
        out = _all_to_all_bytes(encode_rows(g.contiguous(), payload, seed=seed), recv, send, group)
        if stats is not None:
            n = sum(recv) - recv[rank]
            stats.add(key, n, n * row_bytes(payload, d))
        return (decode_rows(out, payload, d, seed=seed).to(dtype),) + (None,) * 9


class _EmulatedWire(torch.autograd.Function):
    """One process: forward ``emulate(x, payload)``, backward ``emulate(g, grad_payload)``."""

    @staticmethod
    def forward(ctx, x, payload, grad_payload, seed):
        ctx.args = (grad_payload, seed, x.dtype)
        return emulate(x.detach(), payload, seed).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        payload, seed, dtype = ctx.args
        return emulate(g.contiguous(), payload, seed).to(dtype), None, None, None


class ExpertParallelMoE(nn.Module):
    """An ``MoE`` whose experts live on the ranks of ``group`` (E divisible by W): built from a full
    ``MoE`` (the same on every rank, e.g. same seed), keeping this rank's slice of the expert weights.
    ``forward(x [B, L, d]) -> [B, L, d]``; ``aux_loss`` and ``stats`` (WireStats) after each call.
    global_aux: form ``aux_loss`` over every rank's tokens (``global_load_balancing_loss``), not this rank's.
    """

    def __init__(self, moe: MoE, comm: CommConfig = CommConfig(), group=None, global_aux: bool = False):
        super().__init__()
        if not isinstance(moe, MoE):
            raise ValueError(f"moe must be a blockscale.nn.MoE, got {type(moe).__name__}")
        if not isinstance(comm, CommConfig):
            raise ValueError(f"comm must be a CommConfig, got {type(comm).__name__}")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        full = moe.experts
        E = full.n_experts
        if full.n_local != E:
            raise ValueError("moe must hold all its experts (a full MoE, not a shard)")
        check_expert_split(E, self.world)
        n_local = E // self.world
        first = self.rank * n_local
        self.cfg, self.comm, self.n_local, self.global_aux = moe.cfg, comm, n_local, bool(global_aux)
        self.router = moe.router
        self.shared_expert = moe.shared_expert
        self.experts = GroupedExperts(E, full.d, full.d_ff, full.recipe, first_expert=first, n_local=n_local,
                                      generator=full.generator)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(self.experts, name).copy_(getattr(full, name)[first:first + n_local])
        self.aux_loss: Tensor | None = None
        self.stats = WireStats()

    def _exchange(self, x, send, recv, payload, grad_payload, keys):
        if self.world == 1:
            return _EmulatedWire.apply(x, payload, grad_payload, self.comm.seed)
        return _AllToAllRows.apply(x, send, recv, payload, grad_payload, keys, self.comm.seed, self.group,
                                   self.stats, self.rank)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if self.global_aux and self.world > 1:
            plan, p = self.router.route(x2d)
            self.aux_loss = global_load_balancing_loss(self.router, p, plan.counts, self.group)
        else:  # one rank: the global batch is this rank's
            plan, self.aux_loss = self.router(x2d)
        W, n = self.world, self.n_local
        if W == 1:
            counts_in = plan.counts.view(1, n)
        else:  # counts_in[r, e]: rows rank r sends to my local expert e
            counts_in = torch.empty_like(plan.counts)
            dist.all_to_all_single(counts_in, plan.counts.contiguous(), group=self.group)
            counts_in = counts_in.view(W, n)
        send = plan.counts.view(W, n).sum(1).tolist()
        recv = counts_in.sum(1).tolist()
        x_recv = self._exchange(dispatch(x2d, plan), send, recv, self.comm.dispatch, self.comm.dispatch_grad,
                                ("dispatch", "dispatch_grad"))
        # received rows come in (source rank, local expert) blocks; the experts want (expert, rank)
        flat = counts_in.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(W, n)
        seg_start, seg_len = starts.t().reshape(-1), counts_in.t().reshape(-1)
        offset = seg_start - (torch.cumsum(seg_len, 0) - seg_len)  # block start minus its new position
        perm = torch.repeat_interleave(offset, seg_len) + torch.arange(int(flat.sum()), device=x.device)
        y = self.experts(x_recv[perm], counts_in.sum(0))
        y_back = torch.empty_like(y).index_copy(0, perm, y)
        y_sorted = self._exchange(y_back, recv, send, self.comm.combine, self.comm.combine_grad,
                                  ("combine", "combine_grad"))
        out = combine(y_sorted, plan, x2d.shape[0])
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2d).float()
        return out.to(x.dtype).view(shape)

    __getstate__ = MoE.__getstate__  # drops aux_loss (tied to the last forward's graph)

    def extra_repr(self) -> str:
        c = self.comm
        return (f"rank={self.rank}/{self.world}, experts {self.experts.first_expert}..{self.experts.first_expert + self.n_local - 1}, "
                f"dispatch={c.dispatch}, combine={c.combine}, grads={c.dispatch_grad}/{c.combine_grad}")


def global_load_balancing_loss(router, p: Tensor, counts: Tensor, group=None) -> Tensor:
    """The load-balancing loss over the tokens of every rank of ``group`` (see ``nn.moe``):

        aux = coef * E * sum_e f_e P_e,  f_e = (sum_r counts_r[e]) / (T k),  P_e = (sum_r sum_t p_r[t, e]) / T

    with T the tokens of all ranks (one all-reduce of [counts, sum_t p, T_r]). Every rank returns this
    same value; its gradient is W times the part of this rank's probabilities, so the mean over ranks
    of the gradients (what DDP / ``sync_expert_parallel_grads`` form) is the gradient of the global
    loss. Equal to ``Router.forward``'s loss on the ranks' tokens concatenated, up to the order of
    the sums."""
    E, k, W = router.n_experts, router.top_k, dist.get_world_size(group)
    p_sum = p.sum(dim=0)
    stats = torch.cat([counts.to(torch.float32), p_sum.detach().float(),
                       torch.full((1,), float(p.shape[0]), device=p.device)])
    dist.all_reduce(stats, group=group)
    n_tokens = float(stats[2 * E])
    if n_tokens == 0:
        return router.weight.sum() * 0.0
    f = stats[:E] / (n_tokens * k)
    P = (stats[E:2 * E] + W * (p_sum - p_sum.detach())) / n_tokens  # value: the global sums
    return router.aux_loss_coef * E * (f * P).sum()


def check_expert_split(n_experts: int, world_size: int) -> None:
    """ValueError naming both numbers unless ``n_experts`` splits evenly over ``world_size`` ranks
    (``ExpertParallelMoE`` gives every rank the same number of experts: uneven shards are not supported)."""
    if n_experts % world_size:
        raise ValueError(f"expert parallelism: n_experts={n_experts} is not divisible by the world size "
                         f"{world_size}: every rank holds the same number of experts (use a world size that "
                         f"divides {n_experts})")


def to_expert_parallel(model: nn.Module, comm: CommConfig = CommConfig(), group=None,
                       global_aux: bool = False) -> list[str]:
    """Replace every ``MoE`` in ``model`` by an ``ExpertParallelMoE`` (in place); returns the names."""
    names = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, ExpertParallelMoE(getattr(owner, child), comm, group, global_aux=global_aux))
    return names


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters sharded over ranks (the local experts of ``ExpertParallelMoE`` layers)."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            out |= {f"{name}.experts.{p}" if name else f"experts.{p}" for p, _ in m.experts.named_parameters()}
    return out


@torch.no_grad()
def sync_expert_parallel_grads(model: nn.Module, group=None) -> None:
    """After ``loss.backward()`` on every rank (loss = this rank's mean): average the replicated
    parameters' gradients over ranks and divide the local experts' by W, so every gradient is that of
    the mean over ranks of the losses. No-op without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    W = dist.get_world_size(group)
    experts = expert_parameter_names(model)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name in experts:
            p.grad.div_(W)
        else:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(W)


__all__ = ["COMBINE_PAYLOADS", "CommConfig", "DISPATCH_PAYLOADS", "ExpertParallelMoE", "GRAD_PAYLOADS", "WireStats",
           "check_expert_split", "expert_parameter_names", "global_load_balancing_loss", "sync_expert_parallel_grads",
           "to_expert_parallel"]
