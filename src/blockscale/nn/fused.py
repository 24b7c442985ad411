"""Fused groups: sibling Linears that serving engines run as one GEMM (q/k/v, gate/up, w1/w3, and
DeepSeek's MLA pair q_a_proj / kv_a_proj_with_mqa, which vLLM loads as one ``fused_qkv_a_proj`` and
SGLang as one ``fused_qkv_a_proj_with_mqa`` when ``q_lora_rank`` is set) and that therefore must share
one NVFP4 outer scale."""
from __future__ import annotations

FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("wq", "wk", "wv"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


def fused_groups(names: list[str]) -> list[list[str]]:
    """Partition module names (dotted paths) into fused groups, in first-appearance order; a name
    outside any group is a group of its own. Siblings = same parent path and names in one of
    ``FUSED_SIBLINGS``."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        kind = next((i for i, sib in enumerate(FUSED_SIBLINGS) if leaf in sib), None)
        key = (parent, kind) if kind is not None else (name, None)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


__all__ = ["FUSED_SIBLINGS", "fused_groups"]
