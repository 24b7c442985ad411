"""compressed-tensors ``transform_config``: online input rotations (``nn.input_rotation``) written and read the way
compressed-tensors (``TransformConfig``, release 0.18) and vLLM's transform loader expect them (docs/formats.md
"Rotations").

Writing: one transform group per rotation group of the model (``R4``, ``v``, ``v64`` ...)::

    {"type": "hadamard" | "random-hadamard",
     "apply": [{"targets": [module names], "location": "input", "inverse": false, "ignore": []},
               {"targets": [module names], "location": "weight_input", "inverse": true, "ignore": []}],
     "randomize": false, "requires_grad": false, "head_dim": <block size>, "precision": "torch.float32"}

``input``: x -> x M / sqrt(n) online; ``weight_input`` with ``inverse`` records that W M / sqrt(n) is already in
the stored weight (an offline location: engines do not apply it again). A group's matrix is stored once,
unnormalised (entries +1 / -1, as compressed-tensors and vLLM hold it), as ``<module>.<group>_input.weight`` of
its first target (sorted names): compressed-tensors saves a shared transform once and vLLM fills every sharer of
a (group, size) from any one key. Fused rotations (R1, R2) are in the weights and not described here.

Key rotations (SpinQuant's R3, ``nn.kv_cache.attach_key_rotation``) are one group ``R3`` whose ``apply`` holds
``q_attn`` and ``k_cache`` entries with the attention modules as targets (llm-compressor's SpinQuant template); its
matrix is stored once as ``<first attention module>.R3_q_attn.weight`` (compressed-tensors names a transform
``<group>_<location>``; the two locations share one matrix).

Reading (``parse_transforms`` then ``resolve``): the same fields (compressed-tensors forbids others), types
hadamard / random-hadamard, locations ``input`` (applied online), ``weight_input`` / ``weight_output`` (offline:
already in the weights), ``q_attn`` + ``k_cache`` together on the same targets (key rotations); ``output``, one
of ``q_attn`` / ``k_cache`` alone, ``randomize`` and ``random-matrix`` are refused with a message naming the key. A module shares its group's stored matrix of its size when its own key is absent
(compressed-tensors writes shared matrices once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import schema
from ..quant.transforms.rotation import Rotation, stored_rotation

_QC = "quantization_config.transform_config"
SCHEME_FIELDS = ("type", "apply", "randomize", "requires_grad", "head_dim", "precision")
ARGS_FIELDS = ("targets", "location", "inverse", "ignore")
LOCATIONS = ("input", "weight_input", "weight_output", "output", "k_cache", "q_attn")
OFFLINE = ("weight_input", "weight_output")
TYPES = ("hadamard", "random-hadamard")
PRECISIONS = ("float32", "torch.float32", "float64", "torch.float64", "bfloat16", "torch.bfloat16", "float16",
              "torch.float16")


ATTENTION_LOCATIONS = ("q_attn", "k_cache")


def matrix_key(module: str, group: str, location: str = "input") -> str:
    return f"{module}.{group}_{location}.weight"


def _apply(names: list, location: str) -> list:
    if location == "attention":
        return [{"targets": names, "location": loc, "inverse": False, "ignore": []} for loc in ATTENTION_LOCATIONS]
    return [{"targets": names, "location": "input", "inverse": False, "ignore": []},
            {"targets": names, "location": "weight_input", "inverse": True, "ignore": []}]


def transform_config(rotations: dict[str, tuple[str, Rotation]], dtype: torch.dtype,
                     keys: Optional[dict[str, tuple[str, Rotation]]] = None) -> tuple[dict, dict]:
    """(``transform_config`` for config.json, {tensor name: the group's ±1 matrix in ``dtype``}) of ``rotations``
    ({module name: (group, rotation)}: online input rotations) and ``keys`` ({attention module name: (group,
    rotation)}: key rotations, R3). ValueError for an identity rotation (no compressed-tensors type), a group
    whose modules hold different matrices, or a group name used by both kinds."""
    groups: dict[str, list] = {}
    where: dict[str, str] = {}
    for kind, table in (("input", rotations), ("attention", keys or {})):
        for name, (group, rot) in table.items():
            if rot.kind not in TYPES:
                raise ValueError(f"{name}: a {rot.kind!r} rotation has no compressed-tensors transform type "
                                 f"({', '.join(TYPES)})")
            if where.setdefault(group, kind) != kind:
                raise ValueError(f"transform group {group!r} holds both input and key rotations")
            groups.setdefault(group, []).append((name, rot))
    config, tensors = {}, {}
    for group, members in groups.items():
        first = members[0][1]
        for name, rot in members[1:]:
            if rot.kind != first.kind or not torch.equal(rot.signed, first.signed):
                raise ValueError(f"{name}: its rotation differs from the others of transform group {group!r}")
        names = sorted(n for n, _ in members)
        config[group] = {
            "type": first.kind,
            "apply": _apply(names, where[group]),
            "randomize": False, "requires_grad": False, "head_dim": first.size, "precision": "torch.float32"}
        loc = "q_attn" if where[group] == "attention" else "input"
        tensors[matrix_key(names[0], group, loc)] = first.signed.to(dtype).contiguous()  # once, as CT saves it
    return ({"config_groups": config} if config else {}), tensors


@dataclass(frozen=True)
class TransformGroup:
    """One parsed group: its name, type, head_dim (None: the module's full size), the targets and ignore
    patterns of its online entries, and where it acts: ``"input"`` (Linear inputs) or ``"attention"`` (queries
    and keys of attention modules: ``q_attn`` + ``k_cache``)."""

    name: str
    type: str
    head_dim: Optional[int]
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    location: str = "input"

    def matches(self, module: str, cls: str = "Linear") -> bool:
        return _match(self.targets, module, cls) and not _match(self.ignore, module, cls)


def _match(patterns, module: str, cls: str = "Linear") -> bool:
    import re

    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == module or p == cls or (cls == "Linear" and p == "nn.Linear"):
            return True
    return False


def _known(d: dict, allowed: tuple, key: str) -> None:
    unknown = [k for k in d if k not in allowed]
    if unknown:
        raise schema.ConfigError(f"{key}: unknown field(s) {schema.short(unknown, 120)} (compressed-tensors defines "
                                 f"{', '.join(allowed)})")


def parse_transforms(qcfg: dict) -> tuple[TransformGroup, ...]:
    """The online input transforms of ``quantization_config.transform_config`` (empty / absent: none);
    ``schema.ConfigError`` naming the key of anything malformed or unsupported."""
    tc = schema.obj(qcfg.get("transform_config"), _QC, optional=True)
    if not tc:
        return ()
    _known(tc, ("config_groups",), _QC)
    groups = schema.obj(tc.get("config_groups"), f"{_QC}.config_groups", optional=True)
    out = []
    for gname, scheme in groups.items():
        key = f"{_QC}.config_groups.{gname}"
        scheme = schema.obj(scheme, key)
        _known(scheme, SCHEME_FIELDS, key)
        kind = schema.string(scheme.get("type"), f"{key}.type", allowed=TYPES)
        if kind is None:
            raise schema.ConfigError(f"{key}.type: missing (blockscale loads {', '.join(TYPES)})")
        if scheme.get("randomize") not in (None, False):
            raise schema.ConfigError(f"{key}.randomize: permuted Hadamard transforms are not supported (vLLM does "
                                     "not load them either)")
        if scheme.get("requires_grad") not in (None, False):
            raise schema.ConfigError(f"{key}.requires_grad: must be false in a stored checkpoint")
        schema.string(scheme.get("precision"), f"{key}.precision", allowed=PRECISIONS)
        hd = scheme.get("head_dim")
        if hd is not None and (isinstance(hd, bool) or not isinstance(hd, int) or hd < 1):
            raise schema.ConfigError(f"{key}.head_dim: {schema.short(hd)} is not a positive integer")
        applies = scheme.get("apply")
        if not isinstance(applies, list):
            raise schema.ConfigError(f"{key}.apply: expected a list")
        targets, ignore, attention = [], [], {}
        for i, a in enumerate(applies):
            akey = f"{key}.apply[{i}]"
            a = schema.obj(a, akey)
            _known(a, ARGS_FIELDS, akey)
            loc = schema.string(a.get("location"), f"{akey}.location", allowed=LOCATIONS)
            t = a.get("targets")
            t = [t] if isinstance(t, str) else schema.str_list(t, f"{akey}.targets")
            ig = a.get("ignore")
            ig = [ig] if isinstance(ig, str) else schema.str_list(ig, f"{akey}.ignore")
            if loc in OFFLINE:
                continue  # already fused into the stored weights
            if loc in ATTENTION_LOCATIONS:
                if a.get("inverse") not in (None, False):
                    raise schema.ConfigError(f"{akey}.inverse: an inverse {loc} transform is not supported")
                if loc in attention:
                    raise schema.ConfigError(f"{akey}.location: {loc!r} appears twice in the group")
                attention[loc] = (tuple(t), tuple(ig))
                continue
            if loc != "input":
                raise schema.ConfigError(f"{akey}.location: {loc!r} transforms are not supported (blockscale applies "
                                         "online 'input' transforms; offline ones are read as stored)")
            if a.get("inverse") not in (None, False):
                raise schema.ConfigError(f"{akey}.inverse: an inverse online input transform is not supported")
            targets += t
            ignore += ig
        if attention:
            out.append(_attention_group(gname, kind, hd, attention, targets, key))
        elif targets:
            out.append(TransformGroup(gname, kind, hd, tuple(targets), tuple(ignore)))
    return tuple(out)


def _attention_group(gname: str, kind: str, hd, attention: dict, inputs: list, key: str) -> TransformGroup:
    """A key-rotation group: ``q_attn`` and ``k_cache`` on the same targets (one without the other changes
    what attention computes), and no ``input`` entries beside them."""
    if inputs:
        raise schema.ConfigError(f"{key}.apply: a group with q_attn / k_cache transforms cannot also hold input "
                                 "transforms (blockscale reads one kind per group)")
    if set(attention) != set(ATTENTION_LOCATIONS):
        have = ", ".join(sorted(attention))
        raise schema.ConfigError(f"{key}.apply: {have} without {' / '.join(set(ATTENTION_LOCATIONS) - set(attention))}"
                                 ": queries and keys must be rotated together (q k^T unchanged)")
    if attention["q_attn"] != attention["k_cache"]:
        raise schema.ConfigError(f"{key}.apply: q_attn and k_cache have different targets / ignore; they must "
                                 "rotate the same attention modules")
    targets, ignore = attention["q_attn"]
    return TransformGroup(gname, kind, hd, targets, ignore, "attention")


def resolve(groups: tuple[TransformGroup, ...], linears: dict[str, int], present: set, where: str,
            attentions: Optional[dict[str, tuple[int, str]]] = None) -> dict[str, tuple[TransformGroup, int, str]]:
    """{module name: (group, block size, the stored key holding its matrix)} for ``linears`` ({on-disk Linear
    name: in_features}) matched by an online input group's targets and ``attentions`` ({attention module name:
    (head_dim, class name)}) matched by a key-rotation group's. ``schema.ConfigError`` when a module is matched
    twice, its size is not a multiple of the group's head_dim, or no matrix of its group and size is stored."""
    out: dict[str, tuple[TransformGroup, int, str]] = {}
    for g in groups:
        attention = g.location == "attention"
        sizes = {n: v[0] for n, v in (attentions or {}).items()} if attention else linears
        classes = {n: v[1] for n, v in (attentions or {}).items()} if attention else {}
        matched = [n for n in sizes if g.matches(n, classes.get(n, "Linear"))]
        for n in matched:
            if n in out:
                raise schema.ConfigError(f"{where}: {n} has two online transforms ({out[n][0].name}, {g.name})")
            size = g.head_dim or sizes[n]
            if sizes[n] % size:
                what = "head_dim" if attention else "in_features"
                raise schema.ConfigError(f"{where}: {n}: {what} {sizes[n]} is not a multiple of transform "
                                         f"group {g.name!r}'s head_dim {size}")
            own = matrix_key(n, g.name, "q_attn" if attention else "input")
            if attention and own not in present and matrix_key(n, g.name, "k_cache") in present:
                own = matrix_key(n, g.name, "k_cache")
            out[n] = (g, size, own)
        shared: dict[int, str] = {}
        for n in matched:
            if out[n][2] in present:
                shared.setdefault(out[n][1], out[n][2])
        for n in matched:
            grp, size, own = out[n]
            if own not in present:
                if size not in shared:
                    raise schema.ConfigError(f"{where}: transform group {g.name!r}: no stored matrix for {n} "
                                             f"(expected {own!r})")
                out[n] = (grp, size, shared[size])
    return out


def read_rotation(group: TransformGroup, size: int, matrix: torch.Tensor, key: str) -> Rotation:
    """The validated rotation of a stored matrix (``stored_rotation``): square of ``size``, ±1, orthogonal."""
    if tuple(matrix.shape) != (size, size):
        raise ValueError(f"{key}: shape {list(matrix.shape)}, expected [{size}, {size}] (transform group "
                         f"{group.name!r})")
    return stored_rotation(group.type, matrix, key)
