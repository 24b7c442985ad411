"""R3 (SpinQuant): queries and keys rotated by a Hadamard of head_dim after RoPE, so the KV cache quantizes
``K H`` instead of ``K`` (``nn.kv_cache.attach_key_rotation``). ``(q H)(K H)^T = q K^T``: without a quantized KV
cache it changes nothing; with one, an outlier channel of the keys is spread over the head before its scale is
taken. Online (an engine rotates both at run time): compressed-tensors' ``q_attn`` + ``k_cache`` transforms."""
from __future__ import annotations

from torch import nn

from ...errors import QuantizationError
from ...nn.kv_cache import attach_key_rotation, attention_modules, key_rotation
from ...quant.transforms.rotation import Rotation, largest_power_of_two_divisor, rotation

GROUP = "R3"


def key_rotation_targets(layers, prefix: str) -> list[tuple[str, nn.Module, int]]:
    """(name, attention module, block) of every decoder layer's attention (one each), the block being the
    largest power of two dividing head_dim; QuantizationError for a layer without one or already rotated."""
    out = []
    for i, layer in enumerate(layers):
        where = f"{prefix}.{i}"
        attns = attention_modules(layer)
        if len(attns) != 1:
            raise QuantizationError(f"{where}: rotation R3 needs one attention module with k_proj / v_proj and a "
                                    f"layer_idx (transformers' attention), found {len(attns)}")
        (rel, attn), = attns.items()
        hd = getattr(attn, "head_dim", None)
        if isinstance(hd, bool) or not isinstance(hd, int) or hd < 2:
            raise QuantizationError(f"{where}.{rel}: rotation R3 needs the attention module's head_dim, found {hd!r}")
        if key_rotation(attn) is not None:
            raise QuantizationError(f"{where}.{rel}: already has a key rotation (rotated twice?)")
        out.append((f"{where}.{rel}", attn, largest_power_of_two_divisor(hd)))
    return out


def apply_key_rotations(targets, kind: str, seed: int) -> tuple[str, int]:
    """Attach R3 to every target (``key_rotation_targets``); (the rotation's description, module count)."""
    cache: dict[int, Rotation] = {}
    for _, attn, n in targets:
        attach_key_rotation(attn, cache.setdefault(n, rotation(kind, n, seed)), GROUP)
    return ", ".join(q.describe() for q in cache.values()), len(targets)
