"""Smoothing groups: where per-input-channel scales ``s`` [K] can be folded in a decoder layer.

A linear layer computes ``y = x W^T``. For any positive vector ``s`` over the K input channels,
``y = (x / s) (W * s)^T`` exactly, so scales can move magnitude between the activations and the
weight columns without changing the full-precision function, as long as ``1 / s`` is folded into
whatever produces ``x`` (the preceding norm's weight, or the output rows of a preceding linear).
A ``SmoothingGroup`` is one such producer and its consumers; ``find_smoothing_groups`` lists them for
the decoder layers it understands. AWQ and SmoothQuant (``ptq.methods``) choose the scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class SmoothingGroup:
    """One place where per-input-channel scales ``s`` [K] can be folded.

    name: e.g. "self_attn.qkv". prev: the module whose output channels are the consumers' inputs:
    a norm whose output is ``normalized(x) * weight (+ bias)`` (RMSNorm / LayerNorm; weight [K]) or
    an ``nn.Linear`` with K output features. linears: the consumers (all with in_features == K).
    linear_names / prev_name: their names relative to the decoder layer.
    """

    name: str
    prev: nn.Module
    linears: tuple[nn.Linear, ...]
    linear_names: tuple[str, ...]
    prev_name: str = ""

    def __post_init__(self):
        linears, names = tuple(self.linears), tuple(self.linear_names)
        object.__setattr__(self, "linears", linears)
        object.__setattr__(self, "linear_names", names)
        if not linears:
            raise ValueError(f"SmoothingGroup {self.name!r}: needs at least one consumer linear")
        if len(names) != len(linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: {len(linears)} linears but {len(names)} linear_names")
        for lin, n in zip(linears, names):
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"SmoothingGroup {self.name!r}: consumer {n!r} is a {type(lin).__name__}, "
                                "expected nn.Linear")
        K = linears[0].in_features
        for lin, n in zip(linears, names):
            if lin.in_features != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: consumer {n!r} has in_features="
                                 f"{lin.in_features}, expected {K} (all consumers share one input)")
        if len({id(m) for m in linears}) != len(linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: a consumer linear is listed twice")
        if not isinstance(self.prev, nn.Module):
            raise TypeError(f"SmoothingGroup {self.name!r}: prev must be an nn.Module, got {type(self.prev).__name__}")
        if any(self.prev is m for m in linears):
            raise ValueError(f"SmoothingGroup {self.name!r}: prev cannot also be a consumer")
        if isinstance(self.prev, nn.Linear):
            if self.prev.out_features != K:
                raise ValueError(f"SmoothingGroup {self.name!r}: prev linear has out_features="
                                 f"{self.prev.out_features}, consumers have in_features={K}")
        else:
            w = getattr(self.prev, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.numel() != K:
                shape = None if not isinstance(w, torch.Tensor) else tuple(w.shape)
                raise ValueError(f"SmoothingGroup {self.name!r}: prev {type(self.prev).__name__} needs a 1-D "
                                 f"per-channel weight of size {K} to absorb the scales, got weight shape {shape}")

    @property
    def in_features(self) -> int:
        """K: the number of channels (length of the smoothing scales)."""
        return self.linears[0].in_features

    def weights(self) -> list[torch.Tensor]:
        """The consumers' weights [N_i, K] (the tensors ``awq_search`` / ``smoothquant_scales`` take)."""
        return [lin.weight for lin in self.linears]


def check_norm_absorbs_scales(norm: nn.Module) -> None:
    """Raise NotImplementedError unless ``norm``'s output is ``f(x) * weight (+ bias)`` per channel,
    i.e. dividing ``weight`` (and ``bias``) by s divides the output by s.

    Checked by a probe: run ``norm.forward`` (hooks are not triggered) on a fixed random input, double
    every other channel of its weight, run again, restore the weight bit for bit. A norm such as
    Gemma's ``x * (1 + weight)`` RMSNorm fails the probe: folding into it would change the model.
    """
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise NotImplementedError(f"{type(norm).__name__} has no 1-D per-channel weight to fold smoothing "
                                  "scales into")
    if w.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"{type(norm).__name__}.weight has dtype {w.dtype}; cannot fold scales into it")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{type(norm).__name__}.weight contains NaN/inf; cannot fold smoothing scales into it")
    K = w.numel()
    bias = getattr(norm, "bias", None)
    bias = bias.detach().float() if isinstance(bias, torch.Tensor) else None
    if bias is not None and bias.shape != w.shape:
        raise NotImplementedError(f"{type(norm).__name__}.bias has shape {tuple(bias.shape)}, weight {tuple(w.shape)}")
    g = torch.Generator().manual_seed(1234)
    probe = torch.randn(2, 3, K, generator=g).to(device=w.device, dtype=w.dtype)
    factor = torch.ones(K, dtype=torch.float32)
    factor[::2] = 2.0  # a power of two: exact in every float dtype
    factor = factor.to(w.device)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            y0 = norm.forward(probe)
            w.mul_(factor.to(w.dtype))
            y1 = norm.forward(probe)
    except Exception as err:  # a norm that needs extra arguments: we cannot vouch for it
        raise NotImplementedError(f"cannot check that {type(norm).__name__} absorbs per-channel scales "
                                  f"(its forward failed on a probe input: {err})") from err
    finally:
        with torch.no_grad():
            w.copy_(saved)
    if not isinstance(y0, torch.Tensor) or y0.shape != probe.shape:
        raise NotImplementedError(f"{type(norm).__name__}: its output is not a tensor shaped like its input; "
                                  "cannot fold smoothing scales into it")
    y0, y1 = y0.detach().float(), y1.detach().float()
    if bias is not None:
        y0, y1 = y0 - bias, y1 - bias
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 2e-2
    scale = float(y0.abs().max()) if y0.numel() else 0.0
    if not torch.allclose(y1, y0 * factor, rtol=tol, atol=tol * scale + 1e-30):
        raise NotImplementedError(
            f"{type(norm).__name__}: scaling its weight does not scale its output per channel (e.g. "
            "Gemma's x * (1 + weight) RMSNorm); folding smoothing scales into it would change the model. "
            "Fold into a plain RMSNorm / LayerNorm, or skip smoothing for this group")


# (layer attribute names) for the decoder layers find_smoothing_groups understands
_LAYOUTS = (
    dict(kind="Hugging Face Llama-style (Llama, Mistral, Qwen2, Qwen3)", norm1="input_layernorm",
         attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj", attn_extra=("q_norm", "k_norm"),
         norm2="post_attention_layernorm", mlp="mlp", gate="gate_proj", up="up_proj", down="down_proj",
         names=("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")),
    dict(kind="blockscale.models.llama.TransformerBlock", norm1="attention_norm", attn="attention",
         q="wq", k="wk", v="wv", o="wo", attn_extra=(), norm2="ffn_norm", mlp="feed_forward",
         gate="w1", up="w3", down="w2",
         names=("attention.qkv", "attention.wo", "feed_forward.w1_w3", "feed_forward.w2")),
)


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _match_layout(layer: nn.Module, lay: dict) -> Optional[str]:
    """None if ``layer`` has exactly this layout, else why not."""
    A, M = lay["attn"], lay["mlp"]
    linears = [f"{A}.{lay[k]}" for k in ("q", "k", "v", "o")] + [f"{M}.{lay[k]}" for k in ("gate", "up", "down")]
    for path in (lay["norm1"], lay["norm2"], *linears):
        if _get(layer, path) is None:
            return f"no submodule {path!r}"
    for path in linears:
        if not isinstance(_get(layer, path), nn.Linear):
            return f"{path!r} is a {type(_get(layer, path)).__name__}, not nn.Linear"
    # every parameter must belong to a module we know the role of: an extra norm (Gemma 2's
    # pre_feedforward_layernorm), a router or experts (MoE), adapters... mean another dataflow
    allowed = [lay["norm1"], lay["norm2"], *linears, *(f"{A}.{e}" for e in lay["attn_extra"])]
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if owner not in allowed:
            return f"parameter {pname!r} belongs to no module of this layout"
    return None


def find_smoothing_groups(layer: nn.Module) -> list[SmoothingGroup]:
    """The smoothing groups of one decoder layer, in the order AWQ processes them.

    Supported: Hugging Face Llama-style layers (LlamaDecoderLayer and the layers that share its names
    and dataflow: Mistral, Qwen2, Qwen3) and ``blockscale.models.llama.TransformerBlock``:

      input_layernorm          -> q_proj, k_proj, v_proj     "self_attn.qkv"
      v_proj                   -> o_proj                     "self_attn.o_proj"  (only without GQA)
      post_attention_layernorm -> gate_proj, up_proj         "mlp.gate_up"
      up_proj                  -> down_proj                  "mlp.down_proj"

    v_proj -> o_proj is skipped when v_proj.out_features != o_proj.in_features (grouped-query
    attention repeats each value head, so one scale per o_proj input cannot be folded into v_proj),
    as AWQ does. The up_proj -> down_proj fold assumes the gated MLP ``down(act(gate(x)) * up(x))``.

    Raises NotImplementedError (naming the layer class) for any other layer, e.g. MoE blocks, fused
    qkv_proj / gate_up_proj, extra norms (Gemma 2/3), and for norms whose weight cannot absorb a
    division (Gemma's ``x * (1 + weight)`` RMSNorm).
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module, got {type(layer).__name__}")
    reasons = []
    for lay in _LAYOUTS:
        why = _match_layout(layer, lay)
        if why is not None:
            reasons.append(f"{lay['kind']}: {why}")
            continue
        A, M = lay["attn"], lay["mlp"]
        g = lambda key, parent: _get(layer, f"{parent}.{lay[key]}")  # noqa: E731
        q, k, v, o = g("q", A), g("k", A), g("v", A), g("o", A)
        gate, up, down = g("gate", M), g("up", M), g("down", M)
        norm1, norm2 = _get(layer, lay["norm1"]), _get(layer, lay["norm2"])
        for path, norm in ((lay["norm1"], norm1), (lay["norm2"], norm2)):
            try:
                check_norm_absorbs_scales(norm)
            except NotImplementedError as err:
                raise NotImplementedError(f"find_smoothing_groups({type(layer).__name__}): {err}") from None
            except ValueError as err:
                raise ValueError(f"find_smoothing_groups({type(layer).__name__}): {path}: {err}") from None
        if up.out_features != down.in_features:
            raise NotImplementedError(f"find_smoothing_groups({type(layer).__name__}): {M}.{lay['up']} has "
                                      f"{up.out_features} outputs but {M}.{lay['down']} {down.in_features} inputs")
        n_qkv, n_o, n_gu, n_d = lay["names"]
        p = lambda key, parent: f"{parent}.{lay[key]}"  # noqa: E731
        groups = [SmoothingGroup(n_qkv, norm1, (q, k, v), (p("q", A), p("k", A), p("v", A)), lay["norm1"])]
        if v.out_features == o.in_features:
            groups.append(SmoothingGroup(n_o, v, (o,), (p("o", A),), p("v", A)))
        groups.append(SmoothingGroup(n_gu, norm2, (gate, up), (p("gate", M), p("up", M)), lay["norm2"]))
        groups.append(SmoothingGroup(n_d, up, (down,), (p("down", M),), p("up", M)))
        return groups
    raise NotImplementedError(
        f"find_smoothing_groups: {type(layer).__name__} is not a supported decoder layer ("
        + "; ".join(reasons) + "). Build SmoothingGroup objects by hand for other architectures")



__all__ = ["FLOAT_DTYPES", "SmoothingGroup", "check_norm_absorbs_scales", "find_smoothing_groups"]
