"""ExpertsLayout: how one family of transformers fused-experts modules keeps its experts (the small adapter
``QuantizedExperts``, PTQ statistics, pre-flight checks and the checkpoint plan read instead of testing for a
family).

Every layout is seen through the same out x in matrices per expert e: ``gate_up`` [2I, H] (gate and up rows;
concatenated, or interleaved as gpt-oss keeps them) and ``down`` [H, I]. A layout says

    claims(m)        the module is of this layout's family (its class): its ``why_not`` decides, no other layout's
    why_not(m)       None when ``m`` has exactly the layout, else why not (a sentence)
    dims(m)          (E, H, I)
    matrices(m)      (gate_up [E, 2I, H], down [E, H, I]) detached, contiguous
    down_input(m, e, x)   expert e's down-projection input for its gate/up input x (the module's own operations)
    forward(ex, hidden_states, top_k_index, top_k_weights, gate_up, down)
                     the replaced class's own forward (``ex._hf_shell``) run on those matrices and ``ex``'s biases
    eager(ex, hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input)
                     its routing loop, each expert's gate/up and down input through ``quantize_input(x, proj, e)``
    biases           {projection: name of the high-precision bias ``ex`` keeps, shaped [E, rows]} (gpt-oss)
    interleaved      gate / up rows alternate, so one expert's gate and up cannot be stored as two Linears

The registered layouts (in the order ``experts_layout_of`` asks them) are in ``nn.experts_layouts``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

_FUSED_PARAMS = ("gate_up_proj", "down_proj")
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


@dataclass(frozen=True)
class ExpertsLayout:
    """One fused-experts layout (see the module docstring)."""

    name: str
    claims: Callable[[nn.Module], bool]
    why_not: Callable[[nn.Module], Optional[str]]
    dims: Callable[[nn.Module], tuple]
    matrices: Callable[[nn.Module], tuple]
    down_input: Callable[[nn.Module, int, torch.Tensor], torch.Tensor]
    forward: Callable[..., torch.Tensor]
    eager: Callable[..., torch.Tensor]
    biases: dict = field(default_factory=dict)
    interleaved: bool = False


def has_fused_expert_parameters(module: nn.Module) -> bool:
    """True when ``module`` owns a 3-D floating-point ``gate_up_proj`` or ``down_proj`` parameter."""
    return any(p is not None and p.is_floating_point() and p.dim() == 3
               for k, p in module._parameters.items() if k in _FUSED_PARAMS)


def shell_of(module: nn.Module) -> nn.Module:
    """A parameterless copy of ``module`` (same class, attributes and child modules) whose forward runs on
    the tensors put into its attributes (``gate_up_proj`` / ``down_proj``, ...)."""
    cls = type(module)
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    for k, v in vars(module).items():
        if k not in _MODULE_INTERNALS:
            shell.__dict__[k] = v
    shell._modules = dict(module._modules)
    shell.training = False
    return shell


def routed_experts(top_k_index: torch.Tensor, num_classes: int, num_experts: int):
    """(expert, top-k positions, token indices) of every expert the routing ``top_k_index`` [T, k] reaches, in
    expert order, found as transformers' eager experts loops find them (a one-hot of ``num_classes`` classes:
    ``num_experts + 1`` where index ``num_experts`` is the "no expert" sentinel, which is skipped)."""
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_classes).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        e = int(expert_idx[0])
        if e == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[e])
        yield e, top_k_pos, token_idx


def run_shell(shell: nn.Module, tensors: dict, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The replaced class's own forward (``shell``: ``shell_of`` it) with ``tensors`` ({attribute: tensor}) in
    place of its parameters."""
    if shell is None:
        raise ValueError("the quantized experts need the experts module they replace to run its forward "
                         "(build them with from_linears / from_experts)")
    shell.__dict__.update(tensors)
    try:
        return type(shell).forward(shell, hidden_states, top_k_index, top_k_weights)
    finally:
        for k in tensors:
            del shell.__dict__[k]


__all__ = ["ExpertsLayout", "has_fused_expert_parameters", "routed_experts", "run_shell", "shell_of"]
