"""FP8 (E4M3) and NVFP4 KV caches for transformers attention modules: calibrated scales, fake quantization, amax
observation.

An attention module ``attn`` (one with ``k_proj`` / ``v_proj`` children and a ``layer_idx``, as
transformers' ``LlamaAttention``) computes the post-RoPE key / value states [B, H_kv, T, D] and hands
them to ``cache.update(key_states, value_states, layer_idx, ...)`` (the ``cache`` kwarg, formerly
``past_key_values``) before the attention function sees them. A forward pre-hook (installed once per
module) replaces that kwarg with a small cache object whose ``update``

    1. records K / V amaxes for every active ``KVAmaxObserver`` (the unquantized post-RoPE values),
    2. fake-quantizes them when the module has scales:  K^ = E4M3_RNE(clamp(K / s_k, -448, 448)) * s_k
       (and V with s_v), s per layer ([1]) or per KV head ([H_kv]); an NVFP4 cache (``set_kv_scales(format=
       "nvfp4")``, per layer) quantizes K to NVFP4 with outer encode scale 1 / s_k and an E4M3 scale per 16
       along head_dim (``nvfp4_kv_fake_quantize``),
    3. forwards K^ / V^ to the real cache's ``update`` if there was one (generation: the cache stores
       K^ / V^) and returns what it returns, else returns (K^, V^) (calibration / evaluation).

With a key rotation (``attach_key_rotation``: SpinQuant's R3, a Hadamard H of head_dim) step 1 records the
amax of K H and step 2 quantizes there: K^ = Q(K H) H^T. Attention then computes q K^^T = (q H) Q(K H)^T,
exactly what an engine rotating queries and keys after RoPE computes (compressed-tensors' ``q_attn`` /
``k_cache`` transforms); without KV scales the rotation cancels and nothing is computed.

This works for any attention implementation (eager, sdpa, ...): they all receive what ``update``
returns. The scales are FP32 buffers ``attn.k_scale`` / ``attn.v_scale`` (state-dict names
``<...>.self_attn.k_scale``, compressed-tensors' names), s = amax / 448 (1 where amax is 0).
Without scales or observers the hook passes the call through unchanged.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from ..errors import UsageError
from ..quant.fp8 import FP8_MAX, dequantize_values, encode_with_scale, scale_from_amax
from ..quant.nvfp4 import BLOCK as NVFP4_BLOCK
from ..quant.nvfp4 import NVFP4, quantize_nvfp4

#: the forward kwarg names of transformers attention modules' cache, newest first
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
KV_ELEMENT = "e4m3"
KV_FORMATS = ("fp8-e4m3", "nvfp4")  # what ``set_kv_scales(format=...)`` takes (recipes' kv_cache.format)
_FORMAT = "_blockscale_kv_format"
_HOOKED = "_blockscale_kv_cache_kwarg"   # set once the pre-hook is installed: the cache kwarg's name
_OBSERVERS = "_blockscale_kv_observers"  # active (observer, name) pairs of a module


# -- numerics -----------------------------------------------------------------------------------
def kv_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """FP32 KV scale s = amax / 448 (1 where that is 0), as quant.fp8's E4M3 scales."""
    return scale_from_amax(torch.as_tensor(amax, dtype=torch.float32), KV_ELEMENT)


def _broadcast_scale(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as FP32 broadcasting to ``t`` [B, H_kv, T, D]: [1] per layer, [H_kv] over dim 1."""
    s = scale.detach().to(device=t.device, dtype=torch.float32)
    if s.numel() == 1:
        return s.reshape(())
    if s.dim() != 1 or t.dim() != 4 or t.shape[1] != s.numel():
        raise UsageError(f"KV scale of shape {tuple(s.shape)} for states of shape {tuple(t.shape)}: expected one "
                         "scale per layer ([1]) or one per KV head ([H_kv], states [B, H_kv, T, D])")
    return s.view(1, -1, 1, 1)


class _FP8KVFakeQuantize(torch.autograd.Function):
    """Forward: E4M3 fake quantization; backward: straight through (identity for t, none for s)."""

    @staticmethod
    def forward(ctx, t, scale):
        s = _broadcast_scale(t, scale)
        return dequantize_values(encode_with_scale(t, s, KV_ELEMENT), s).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _NVFP4KVFakeQuantize(torch.autograd.Function):
    """Forward: NVFP4 fake quantization with outer encode scale 1 / s; backward: straight through."""

    @staticmethod
    def forward(ctx, t, scale):
        S = 1.0 / scale.detach().to(device=t.device, dtype=torch.float32).reshape(1)
        return quantize_nvfp4(t.to(torch.float32), NVFP4(), outputs="values", encode_scale=S).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def nvfp4_kv_fake_quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The engines' NVFP4 KV cache (TensorRT-LLM, vLLM, FlashInfer; docs/formats.md): with the per-layer scale
    s = amax / 448 (one element), outer encode scale S = 1 / s (FP32), per 16 values along the last dim (head_dim)
    the block scale e4m3(min(block_amax * (S / 6), 448)), codes E2M1_RNE(clamp(x * e, -6, 6)), x^ = q * b * (1/S)
    (``quant.nvfp4`` with ``encode_scale=S``). Backward straight through, as ``fp8_kv_fake_quantize``."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise UsageError(f"t must be a floating torch.Tensor, got {type(t).__name__}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise UsageError("the NVFP4 KV cache takes one scale per layer (a one-element tensor), got "
                         f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if t.shape[-1] % NVFP4_BLOCK:
        raise UsageError(f"the NVFP4 KV cache quantizes blocks of {NVFP4_BLOCK} along head_dim; head_dim "
                         f"{t.shape[-1]} is not a multiple")
    return _NVFP4KVFakeQuantize.apply(t, scale)


def fp8_kv_fake_quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3_RNE(clamp(t / s, -448, 448)) * s in FP32, returned in t's dtype; s per layer ([1]) or per
    KV head ([H_kv], broadcast over dim 1 of t [B, H_kv, T, D]). The backward is straight through
    (d out / d t = identity; no gradient for s), so distillation / scale learning trains through it."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise UsageError(f"t must be a floating torch.Tensor, got {type(t).__name__}"
                         f"{'' if not isinstance(t, torch.Tensor) else ' of dtype ' + str(t.dtype)}")
    return _FP8KVFakeQuantize.apply(t, scale)


# -- modules ------------------------------------------------------------------------------------
def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the attention modules: those with ``k_proj`` and ``v_proj`` children and a
    ``layer_idx`` (transformers' decoder-layer attention), in model order."""
    out = {}
    for name, m in model.named_modules():
        children = dict(m.named_children())
        if "k_proj" in children and "v_proj" in children and hasattr(m, "layer_idx"):
            out[name] = m
    return out


def _num_kv_heads(attn: nn.Module) -> Optional[int]:
    """H_kv = k_proj.out_features / head_dim, or None when the module does not say."""
    head_dim = getattr(attn, "head_dim", None)
    n = getattr(getattr(attn, "k_proj", None), "out_features", None)
    if isinstance(head_dim, int) and isinstance(n, int) and head_dim > 0 and n % head_dim == 0:
        return n // head_dim
    return None


def _module_device(attn: nn.Module) -> torch.device:
    for t in attn.parameters():
        return t.device
    for t in attn.buffers():
        return t.device
    return torch.device("cpu")


def _check_scale(attn: nn.Module, name: str, s) -> torch.Tensor:
    if not isinstance(s, torch.Tensor) or not s.is_floating_point():
        raise UsageError(f"{name} must be a floating torch.Tensor, got {type(s).__name__}")
    heads = _num_kv_heads(attn)
    if s.numel() != 1 and (s.dim() != 1 or (heads is not None and s.numel() != heads)):
        want = f"[{heads}] per KV head" if heads is not None else "[H_kv] per KV head"
        raise UsageError(f"{name} has shape {tuple(s.shape)}; expected [1] (one scale per layer) or {want}")
    s = s.detach().to(device=_module_device(attn), dtype=torch.float32).reshape(-1).clone()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise UsageError(f"{name} = {s.tolist()}: KV scales must be finite and positive (s = amax / 448)")
    return s


def _install_hook(attn: nn.Module) -> None:
    """Install the cache-kwarg pre-hook once (it is a no-op while the module has no scales / observers)."""
    if attn.__dict__.get(_HOOKED):
        return
    params = inspect.signature(attn.forward).parameters
    kwarg = next((n for n in CACHE_KWARGS if n in params), None)
    if kwarg is None:
        raise UsageError(f"{type(attn).__name__}.forward takes none of {', '.join(CACHE_KWARGS)}: the FP8 KV cache "
                         "hooks transformers attention modules (which pass post-RoPE K/V to cache.update)")
    attn.register_forward_pre_hook(_kv_pre_hook, with_kwargs=True)
    setattr(attn, _HOOKED, kwarg)


def set_kv_scales(attn: nn.Module, k_scale: torch.Tensor, v_scale: torch.Tensor, format: str = "fp8-e4m3") -> None:
    """Register (or overwrite) FP32 buffers ``attn.k_scale`` / ``attn.v_scale`` ([1] per layer or
    [H_kv] per KV head, both the same shape; "nvfp4": [1]) and install the fake-quant hook (once). ``format``:
    the cache's element format (``KV_FORMATS``), s = amax / 448 for both."""
    if format not in KV_FORMATS:
        raise UsageError(f"KV cache format={format!r}; allowed: {', '.join(KV_FORMATS)}")
    k = _check_scale(attn, "k_scale", k_scale)
    v = _check_scale(attn, "v_scale", v_scale)
    if k.shape != v.shape:
        raise UsageError(f"k_scale has shape {tuple(k.shape)} but v_scale {tuple(v.shape)}: use one granularity "
                         "(per layer [1] or per KV head [H_kv]) for both")
    if format == "nvfp4":
        hd = getattr(attn, "head_dim", None)
        if k.numel() != 1:
            raise UsageError(f"an NVFP4 KV cache takes one k_scale / v_scale per layer ([1]), got {tuple(k.shape)}")
        if isinstance(hd, int) and hd % NVFP4_BLOCK:
            raise UsageError(f"an NVFP4 KV cache quantizes blocks of {NVFP4_BLOCK} along head_dim; this attention's "
                             f"head_dim is {hd}")
    _install_hook(attn)
    attn.register_buffer("k_scale", k)
    attn.register_buffer("v_scale", v)
    setattr(attn, _FORMAT, format)


def kv_scales(attn: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) of an attention module, or None when it has no KV quantization."""
    k, v = attn._buffers.get("k_scale"), attn._buffers.get("v_scale")
    return None if k is None or v is None else (k, v)


def kv_format(attn: nn.Module) -> Optional[str]:
    """The KV cache's element format of an attention module ("fp8-e4m3" / "nvfp4"), or None without scales."""
    return attn.__dict__.get(_FORMAT, "fp8-e4m3") if kv_scales(attn) is not None else None


def remove_kv_quantization(attn: nn.Module) -> None:
    """Drop ``attn.k_scale`` / ``attn.v_scale``: the module computes full-precision K/V again (the
    installed hook stays, as a pass-through)."""
    for name in ("k_scale", "v_scale"):
        attn._buffers.pop(name, None)
    attn.__dict__.pop(_FORMAT, None)


# -- the hook -----------------------------------------------------------------------------------
def attach_key_rotation(attn: nn.Module, rot, group: str = "R3") -> None:
    """Quantize ``attn``'s post-RoPE keys in a rotated basis (``rot``: a ``quant.transforms.rotation.Rotation``
    whose block divides head_dim; see the module docstring). Refused when the module already has one."""
    if key_rotation(attn) is not None:
        raise UsageError(f"{type(attn).__name__} already has a key rotation ({attn.key_rotation_group})")
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int):
        rot.check_dim(head_dim, f"{type(attn).__name__} head_dim")
    attn.key_rotation = rot
    attn.key_rotation_group = str(group)


def key_rotation(attn: nn.Module):
    """The attention module's key rotation (``attach_key_rotation``), or None."""
    return getattr(attn, "key_rotation", None)


def key_rotations(model: nn.Module) -> dict:
    """{attention module name: (group, rotation)} of every module with a key rotation."""
    return {name: (m.key_rotation_group, m.key_rotation) for name, m in model.named_modules()
            if key_rotation(m) is not None}


def _process(attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Observe then (with scales) fake-quantize one call's post-RoPE K / V (K in the key rotation's basis)."""
    rot = key_rotation(attn)
    kr = rot.apply(k) if rot is not None else k
    for observer, name in tuple(attn.__dict__.get(_OBSERVERS, ())):
        observer.record(name, kr, v)
    scales = kv_scales(attn)
    if scales is not None:
        fq = nvfp4_kv_fake_quantize if kv_format(attn) == "nvfp4" else fp8_kv_fake_quantize
        kq = fq(kr, scales[0])
        k, v = (rot.unapply(kq) if rot is not None else kq), fq(v, scales[1])
    return k, v


class _QuantizingCache:
    """Stands in for an attention call's cache: ``update`` quantizes K/V, then calls the real cache."""

    def __init__(self, attn: nn.Module, real):
        self._attn, self._real = attn, real

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = _process(self._attn, key_states, value_states)
        if self._real is None:
            return k, v
        return self._real.update(k, v, *args, **kwargs)

    def __getattr__(self, name: str):
        real = self.__dict__.get("_real")
        if real is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(real, name)


def _active(attn: nn.Module) -> bool:
    return kv_scales(attn) is not None or bool(attn.__dict__.get(_OBSERVERS))


def _kv_pre_hook(attn: nn.Module, args: tuple, kwargs: dict):
    """Replace the cache kwarg (or positional argument) with a ``_QuantizingCache``."""
    if not _active(attn):
        return None
    key = next((n for n in CACHE_KWARGS if n in kwargs), None)
    if key is None:
        key = attn.__dict__[_HOOKED]
        idx = list(inspect.signature(attn.forward).parameters).index(key)
        if idx < len(args):
            args = args[:idx] + (_QuantizingCache(attn, args[idx]),) + args[idx + 1:]
            return args, kwargs
    kwargs[key] = _QuantizingCache(attn, kwargs.get(key))
    return args, kwargs


# -- calibration --------------------------------------------------------------------------------
class KVAmaxObserver:
    """Running post-RoPE K / V amaxes of attention modules while active (a context manager):

        with observe_kv(attention_modules(model), per_head=False) as obs:
            model(calibration_batch)
        obs.amax   # {name: (k_amax, v_amax)}, FP32 [1] (or [H_kv] per head)

    The amaxes are of the unquantized K / V (before any fake quantization of the module itself).
    """

    def __init__(self, attn_modules: dict, per_head: bool = False):
        self.modules = dict(attn_modules)
        self.per_head = bool(per_head)
        self._amax: dict[str, list] = {}

    def __enter__(self) -> "KVAmaxObserver":
        for name, attn in self.modules.items():
            _install_hook(attn)
            if _OBSERVERS not in attn.__dict__:
                setattr(attn, _OBSERVERS, [])
            attn.__dict__[_OBSERVERS].append((self, name))
        return self

    def __exit__(self, *exc) -> None:
        for attn in self.modules.values():
            pairs = attn.__dict__.get(_OBSERVERS, [])
            pairs[:] = [p for p in pairs if p[0] is not self]

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        a = t.detach().abs().to(torch.float32)
        if self.per_head:
            if t.dim() != 4:
                raise UsageError(f"per-head KV amax needs states [B, H_kv, T, D]; got shape {tuple(t.shape)}")
            return a.amax(dim=(0, 2, 3))
        return a.amax().reshape(1)

    def record(self, name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold one call's K / V into the running amaxes of module ``name``."""
        new = [self._reduce(k), self._reduce(v)]
        old = self._amax.get(name)
        self._amax[name] = new if old is None else [torch.maximum(o, n) for o, n in zip(old, new)]

    @property
    def amax(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{name: (k_amax, v_amax)} of the modules that ran while observed."""
        return {name: (k, v) for name, (k, v) in self._amax.items()}

    def scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{name: (k_scale, v_scale)} = amax / 448 (``kv_scale_from_amax``)."""
        return {name: (kv_scale_from_amax(k), kv_scale_from_amax(v)) for name, (k, v) in self._amax.items()}


def observe_kv(attn_modules: dict, per_head: bool = False) -> KVAmaxObserver:
    """A ``KVAmaxObserver`` of ``attn_modules`` ({name: attention module}); use it in a ``with`` block."""
    return KVAmaxObserver(attn_modules, per_head)


KV_MAX = FP8_MAX[KV_ELEMENT]

__all__ = ["CACHE_KWARGS", "KVAmaxObserver", "KV_MAX", "attach_key_rotation", "attention_modules",
           "fp8_kv_fake_quantize", "key_rotation", "key_rotations", "KV_FORMATS", "kv_format", "kv_scale_from_amax",
           "kv_scales", "nvfp4_kv_fake_quantize", "observe_kv", "remove_kv_quantization", "set_kv_scales"]
