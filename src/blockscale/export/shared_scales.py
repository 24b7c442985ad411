"""The checks that fused groups share their scales. Fused groups (q/k/v, gate/up, w1/w3 under one
parent; which names form one is ``nn.fused``): serving engines load them as one GEMM and
take the max of the partition outer scales without rescaling block scales, so every member must be
stored with the same FP32 outer scale (and, for W4A4, the same activation scale)."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..nn.fused import FUSED_SIBLINGS, fused_groups


def sibling_groups(names: list[str]) -> list[list[str]]:
    """The fused groups (2+ members) among the Linear module ``names``."""
    return [g for g in fused_groups(list(names)) if len(g) > 1]


def _fmt(v: torch.Tensor) -> str:
    x = float(v.reshape(-1)[0])
    return f"{x!r} (0x{v.reshape(-1)[:1].to(torch.float32).view(torch.int32).item() & 0xFFFFFFFF:08x})"


def check_shared_scales(scales: Mapping[str, Optional[torch.Tensor]], what: str, groups: list[list[str]],
                        hint: str = "") -> None:
    """Raise ValueError if the members of a fused group have different ``scales`` (compared bit for bit).
    ``scales``: module name -> FP32 scalar tensor (modules absent from the map are skipped)."""
    for group in groups:
        present = [n for n in group if n in scales and scales[n] is not None]
        if len(present) < 2:
            continue
        vals = [scales[n].detach().to("cpu", torch.float32).reshape(-1)[:1] for n in present]
        bits = {int(v.view(torch.int32).item()) for v in vals}
        if len(bits) > 1:
            listing = ", ".join(f"{n}={_fmt(v)}" for n, v in zip(present, vals))
            raise ValueError(
                f"fused modules {present} have different {what}: {listing}. Serving engines (vLLM, SGLang, "
                "TensorRT-LLM) run them as one GEMM with a single outer scale (the max) and do not rescale the "
                "block scales, so they would load wrong weights. Quantize the group with one shared encode "
                f"scale S = outer_scale(max amax over the group).{hint}")


def check_group_membership(quantized: set[str], linears: list[str]) -> None:
    """A fused group must be all NVFP4 or all high precision (engines cannot mix them in one GEMM)."""
    for group in sibling_groups(linears):
        q = [n for n in group if n in quantized]
        if q and len(q) != len(group):
            hp = [n for n in group if n not in quantized]
            raise ValueError(f"fused modules {group}: {q} are NVFP4 but {hp} are high precision; serving engines "
                             "load the group as one layer, so quantize all of them or none")


__all__ = ["FUSED_SIBLINGS", "check_group_membership", "check_shared_scales", "sibling_groups"]
