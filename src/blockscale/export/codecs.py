"""Tensor codecs: how one checkpoint format stores the Linears of one tensor kind, registered per
(checkpoint format, tensor kind) and matched against a module's scheme like compressed-tensors'
compressors. Each checkpoint format module registers its codecs beside its ``CheckpointFormat``:

    register_codec(TensorCodec(format="modelopt", kind=tensor_kinds.FP8, stores=lambda s: s in ALGO_OF, ...))
    codec_for(fmt, ModuleScheme("fp8", "block", "block"), "model.layers.0.mlp.up_proj")
        -> ValueError: the format's own message (``CheckpointFormat.unsupported``) for a scheme no codec stores

Contract of a ``TensorCodec`` (``s``: the module's ``ModuleScheme``; N, K = out / in features):

    export(s, {buffer: tensor}) -> {on-disk suffix: tensor}, in the buffers' order
    read(s, {suffix: tensor}) -> {buffer: tensor}; ValueError for an unusable stored scale
    expected(s, N, K) -> {suffix: (allowed dtypes, allowed shapes)}
    describe(s) -> the scheme as the format's config states it (a config group's args, a quant_algo)
    check(name, module, s) -> None; ValueError when the module cannot be stored bit for bit
    check_stored(s, name, N, K, view(suffix), path(suffix)) -> None; CheckpointError for a stored value
      a loader must refuse
    siblings_share(s) / experts_share(s) -> suffixes fused siblings / one expert's gate and up must hold
      bit for bit equal on disk (checked when loading)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from .scheme_types import ModuleScheme
from .tensor_kinds import TensorKind


def _every(s: ModuleScheme) -> bool:
    return True


def _no_check(name: str, m: nn.Module, s: ModuleScheme) -> None:
    return None


def _nothing(s: ModuleScheme) -> tuple:
    return ()


@dataclass(frozen=True)
class TensorCodec:
    """One (checkpoint format, tensor kind) pair (see the module docstring). ``stores``: the schemes of
    ``kind`` the format has a representation for (default: all of them)."""

    format: str
    kind: TensorKind
    export: Callable[[ModuleScheme, dict], dict]
    read: Callable[[ModuleScheme, dict], dict]
    expected: Callable[[ModuleScheme, int, int], dict]
    describe: Callable[[ModuleScheme], Any]
    check_stored: Callable[..., None]
    stores: Callable[[ModuleScheme], bool] = _every
    check: Callable[[str, nn.Module, ModuleScheme], None] = _no_check
    siblings_share: Callable[[ModuleScheme], tuple] = _nothing
    experts_share: Callable[[ModuleScheme], tuple] = _nothing

    def matches(self, s: ModuleScheme) -> bool:
        return self.kind.matches(s) and self.stores(s)


_CODECS: dict[str, list[TensorCodec]] = {}


def register_codec(codec: TensorCodec) -> TensorCodec:
    """Add ``codec`` for its format (looked up by name; the format may be registered before or after)."""
    if not isinstance(codec, TensorCodec):
        raise TypeError(f"register_codec expects a blockscale.export.codecs.TensorCodec, got {type(codec).__name__}")
    _CODECS.setdefault(codec.format, []).append(codec)
    return codec


def unregister_codecs(format_name: str) -> None:
    """Remove every codec of ``format_name`` (nothing if none)."""
    _CODECS.pop(format_name, None)


def codecs_of(format_name: str) -> tuple[TensorCodec, ...]:
    return tuple(_CODECS.get(format_name, ()))


def find_codec(format_name: str, s: ModuleScheme) -> Optional[TensorCodec]:
    """The first codec of ``format_name`` that matches ``s``; None when none does."""
    return next((c for c in _CODECS.get(format_name, ()) if c.matches(s)), None)


def refusal(fmt, schemes: dict, kv: Optional[str]) -> Optional[str]:
    """Why ``fmt`` cannot store ``schemes`` / ``kv`` KV-cache scales for want of a codec or KV naming (None: it can)."""
    missing = {n: s for n, s in schemes.items() if find_codec(fmt.name, s) is None}
    if missing and fmt.unsupported is not None:
        name, s = next(iter(missing.items()))
        return fmt.unsupported(name, s)
    what = sorted({s.name for s in missing.values()}) or (["FP8 KV-cache scales"] if kv and fmt.kv is None else [])
    if not what:
        return None
    nouns = " / ".join(dict.fromkeys(c.kind.noun for c in codecs_of(fmt.name)))
    return f"checkpoint format {fmt.name!r} stores {nouns} Linears only, not {', '.join(what)}; use " \
           "format='compressed-tensors'"


def check_stores(fmt, schemes: dict, kv: Optional[str]) -> None:
    """ValueError naming the module and scheme when ``fmt`` (a ``registry.CheckpointFormat``) has no codec
    for a scheme of ``schemes`` ({module: ModuleScheme}) or cannot hold ``kv`` (None | "tensor" | "head")
    KV-cache scales, then the format's own rules (``CheckpointFormat.check``)."""
    msg = refusal(fmt, schemes, kv)
    if msg is not None:
        raise ValueError(msg)
    fmt.check(schemes, kv)


def codec_for(fmt, s: ModuleScheme, module: str = "") -> TensorCodec:
    """The codec of ``fmt`` (a ``registry.CheckpointFormat``) that stores ``s``; ValueError with the
    format's message (naming ``module``) when it has none."""
    codec = find_codec(fmt.name, s)
    if codec is None:
        raise ValueError(refusal(fmt, {module: s}, None))
    return codec


__all__ = ["TensorCodec", "check_stores", "codec_for", "codecs_of", "find_codec", "refusal", "register_codec",
           "unregister_codecs"]
