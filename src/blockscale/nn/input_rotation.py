"""Online input rotations: a module whose input is multiplied by a rotation before its forward (``x -> x Q``,
compressed-tensors' "input" transform location; ``quant.transforms.rotation``).

``attach_input_rotation(module, rot, group)`` stores the rotation on the module (``module.input_rotation``,
``module.input_rotation_group``: the transform group's name an export writes) and registers one forward
pre-hook that applies it, so every forward, a quantized module's input quantizer and every statistics hook
(forward hooks see the rotated input) use the rotated activations. The weight must already hold ``W Q``
(``Rotation.fold_input``) for the module to compute the same function. ``carry_input_rotation(old, new)``
moves it to a module that replaces another (PTQ's quantized Linears, a checkpoint's modules).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ..quant.transforms.rotation import Rotation

_HANDLE = "_input_rotation_handle"


def _rotate_input(module: nn.Module, args):
    rot = getattr(module, "input_rotation", None)
    if rot is None or not args:
        return None
    return (rot.apply(args[0]),) + tuple(args[1:])


def input_rotation(module: nn.Module) -> Optional[Rotation]:
    """The module's online input rotation, or None."""
    return getattr(module, "input_rotation", None)


def attach_input_rotation(module: nn.Module, rot: Rotation, group: str) -> None:
    """Rotate ``module``'s input online by ``rot`` (refused when it already has one, or when the module's
    in_features is not a multiple of the rotation's size)."""
    if input_rotation(module) is not None:
        raise ValueError(f"{type(module).__name__} already has an online input rotation "
                         f"({module.input_rotation_group})")
    k = getattr(module, "in_features", None)
    if k is not None:
        rot.check_dim(int(k), f"{type(module).__name__} in_features")
    module.input_rotation = rot
    module.input_rotation_group = str(group)
    if getattr(module, _HANDLE, None) is None:
        setattr(module, _HANDLE, module.register_forward_pre_hook(_rotate_input))


def carry_input_rotation(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the online input rotation ``old`` has (nothing when it has none)."""
    rot = input_rotation(old)
    if rot is not None and input_rotation(new) is not rot:  # (a wrapper's inner module may hold it already)
        attach_input_rotation(new, rot, old.input_rotation_group)


def input_rotations(model: nn.Module) -> dict[str, tuple[str, Rotation]]:
    """{module name: (group, rotation)} of every module with an online input rotation."""
    return {name: (m.input_rotation_group, m.input_rotation) for name, m in model.named_modules()
            if input_rotation(m) is not None}
