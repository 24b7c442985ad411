"""A mixture-of-experts routing configuration that transformers builds but whose forward would fail with an
internal error, refused up front naming the config (shared by the in-memory and the streaming loaders)."""
from __future__ import annotations

from ..errors import CheckpointError

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_model_config(config, where) -> None:
    """CheckpointError naming ``where`` (a config.json or model name) for a configuration transformers builds
    but whose forward fails with an internal error: a mixture of experts routing each token to more experts
    (``num_experts_per_tok``) than it has, or to more expert groups (``topk_group``) than ``n_group``."""
    def count(name):
        v = getattr(config, name, None)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    k = count("num_experts_per_tok")
    experts = next(((n, count(n)) for n in _EXPERT_COUNTS if count(n) is not None), None)
    if k is not None and experts is not None and experts[1] > 0 and not 1 <= k <= experts[1]:
        raise CheckpointError(f"{where}: num_experts_per_tok={k} must be between 1 and {experts[0]}={experts[1]} "
                              "(each token is routed to that many of the experts)")
    groups, topk_groups = count("n_group"), count("topk_group")
    if groups is not None and topk_groups is not None and groups > 0 and not 1 <= topk_groups <= groups:
        raise CheckpointError(f"{where}: topk_group={topk_groups} must be between 1 and n_group={groups}")


__all__ = ["check_model_config"]
