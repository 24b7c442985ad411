"""The one quantized inference Linear: a weight ``QuantizedTensor`` held in buffers, an optional input
quantizer, an optional bias; ``y = quantize_input(x) @ dequantize(W)^T + b``.

The weight's buffers come from its format's layout (``quant.format_of(spec).layout(spec, (N, K))``), under
the names checkpoints use (compressed-tensors'), one per ``QuantizedTensor`` field:

    codes        "weight_packed" when the layout packs them (uint8, fewer columns than K), else "weight"
    scales       "weight_scale"  (a 0-d per-tensor scale is stored as [1])
    outer_scale  "weight_global_scale" [1]  (formats whose ``fields`` include it: NVFP4's encode scale S)

so a format's Linear needs no storage code of its own. ``NVFP4Linear``, ``FP8Linear`` and ``MXLinear`` are
this class with their constructors (the load-compatible names and arguments) and their input
quantization: static with a calibrated scale buffer (NVFP4 ``input_global_scale``, FP8 ``input_scale``)
or dynamic (FP8 per token / 1x128 block, MX per 32). The input quantizer runs straight-through (forward:
its output bit for bit; backward: the identity). The dequantized weight is cached (not part of the state
dict) and rebuilt when a weight buffer changes; ``.to(dtype)`` casts the bias only.
"""
from __future__ import annotations

import functools
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import QuantizedTensor, format_of
from ..quant.schemes import stored_scheme_name
from .straight_through import straight_through

GLOBAL_SCALE = "weight_global_scale"


def keep_buffer_dtypes(module: nn.Module, apply, fn, recurse, follow=()):
    """``apply(fn, recurse)`` (``nn.Module._apply``) with the module's own buffers keeping their dtype:
    ``module.to(torch.bfloat16)`` moves FP8 codes and FP32 scales, it never casts them (only the bias and
    the buffers named in ``follow``, e.g. gpt-oss experts' biases)."""
    before = {name: b for name, b in module._buffers.items() if b is not None and name not in follow}
    out = apply(fn, recurse)
    for name, old in before.items():
        new = module._buffers.get(name)
        if new is not None and new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)
    return out


def weight_buffers(spec, out_features: int, in_features: int) -> dict[str, tuple[str, tuple, torch.dtype]]:
    """{buffer name: (QuantizedTensor field, stored shape, dtype)} of a [N, K] weight in ``spec``'s format
    (see the module docstring)."""
    return dict(_weight_buffers(spec, out_features, in_features))


@functools.lru_cache(maxsize=1024)
def _weight_buffers(spec, out_features: int, in_features: int) -> tuple:
    """``weight_buffers`` as items, computed once per (spec, N, K): every forward's cache check reads it."""
    fmt = format_of(spec)
    layout = fmt.layout(spec, (out_features, in_features))
    codes_shape, codes_dtype = layout["codes"]
    scales_shape, scales_dtype = layout["scales"]
    packed = tuple(codes_shape) != (out_features, in_features)
    out = {"weight_packed" if packed else "weight": ("codes", tuple(codes_shape), codes_dtype),
           "weight_scale": ("scales", tuple(scales_shape) or (1,), scales_dtype)}
    if "outer_scale" in fmt.fields:
        out[GLOBAL_SCALE] = ("outer_scale", (1,), torch.float32)
    return tuple(out.items())


class QuantizedInferenceLinear(nn.Module):
    """A Linear whose weight is ``weight_spec`` (any registered format) stored as ``weight_buffers`` says.

    Subclasses set how inputs are quantized (``quantize_input``; default: not at all) and what the stored
    scheme is (``stored``: (kind, weights, inputs) as ``quant.schemes`` names them).
    """

    #: initial value of buffers an empty module holds until a checkpoint fills them (default 0)
    initial_values: ClassVar[dict] = {}
    #: the stored kind (first field of ``stored``) a subclass holds; ``class_for(kind)`` finds it
    kind: ClassVar[str] = ""
    #: one-element buffers that fused experts (``QuantizedExperts``) stack as [E] rather than [E, 1] (NVFP4's
    #: outer and input scales, as its experts checkpoints and scale learning have always held them)
    stacked_flat: ClassVar[frozenset] = frozenset()
    _by_kind: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind and cls.kind not in QuantizedInferenceLinear._by_kind:
            QuantizedInferenceLinear._by_kind[cls.kind] = cls

    @staticmethod
    def class_for(kind: str) -> type:
        """The Linear class of a stored kind ("nvfp4", "fp8", "mx"); ValueError naming the known kinds."""
        try:
            return QuantizedInferenceLinear._by_kind[kind]
        except KeyError:
            raise ValueError(f"no quantized Linear stores kind {kind!r}; known: "
                             f"{', '.join(map(repr, sorted(QuantizedInferenceLinear._by_kind)))}") from None

    @classmethod
    def empty(cls, stored: tuple, in_features: int, out_features: int, bias: bool = False, *,
              rules: Optional[dict] = None, dtype: torch.dtype = torch.float32,
              device=None) -> "QuantizedInferenceLinear":
        """An empty Linear (buffers at their initial values) of a stored (kind, weights, inputs) triple;
        ``rules``: what the triple does not say ({"input_scale_rule", "input_error", "scale_rule"})."""
        raise NotImplementedError

    @classmethod
    def from_scheme(cls, q: QuantizedTensor, bias: Optional[torch.Tensor], scheme, input_amax: float,
                    dtype: torch.dtype) -> "QuantizedInferenceLinear":
        """The Linear of quantized weight ``q`` under ``scheme`` (a ``recipes.Scheme``: its ``stored`` triple and
        options), a static input scale from the calibrated ``input_amax`` where the scheme has one."""
        raise NotImplementedError

    def __init__(self, weight_spec, in_features: int, out_features: int, bias: bool = False, *,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for name, (_, shape, buf_dtype) in weight_buffers(weight_spec, out_features, in_features).items():
            fill = self.initial_values.get(name, 0)
            self.register_buffer(name, torch.full(shape, fill, dtype=buf_dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self._cache: Optional[tuple] = None
        self._dtype = dtype

    @property
    def weight_spec(self):
        """The weight's format spec (the subclass's, from its own attributes: streaming PTQ records a
        Linear's plain attributes only)."""
        raise NotImplementedError

    def _weight_fields(self) -> dict[str, tuple]:
        """{buffer name: (QuantizedTensor field, stored shape)} (``weight_buffers``)."""
        return {n: (f, shape) for n, (f, shape, _) in
                _weight_buffers(self.weight_spec, self.out_features, self.in_features)}

    @property
    def codes(self) -> torch.Tensor:
        """The buffer holding the weight's codes (``weight_packed`` or ``weight``)."""
        return getattr(self, next(n for n, (field, _) in self._weight_fields().items() if field == "codes"))

    @property
    def stored(self) -> tuple:
        """(kind, weights, inputs) of this Linear in a checkpoint (``quant.schemes``)."""
        raise NotImplementedError

    @property
    def rules(self) -> dict:
        """What ``stored`` does not say and ``empty(rules=...)`` takes back (NVFP4 W4A4 ``input_scale_rule`` /
        ``input_error``, the MX activations' ``scale_rule``); {} when nothing."""
        return {}

    @property
    def scheme_name(self) -> str:
        """The scheme this Linear stores (a row of ``quant.schemes.SCHEME_TABLE``)."""
        return stored_scheme_name(*self.stored)

    def load_quantized(self, q: QuantizedTensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy ``q``'s fields into the weight buffers (shapes as the layout says) and ``bias``."""
        for name, (field, shape) in self._weight_fields().items():
            src, dst = getattr(q, field), getattr(self, name)
            src = src.reshape(shape) if src.dim() == 0 else src
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"q.{field} has shape {tuple(src.shape)}; {type(self).__name__}.{name} of a "
                                 f"({self.out_features}, {self.in_features}) weight has {tuple(dst.shape)}")
            dst.copy_(src)
        if bias is not None:
            self.bias.data.copy_(bias.detach())

    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a ``QuantizedTensor`` (shares the buffers)."""
        return self.quantized_tensor_of({name: getattr(self, name) for name in self._weight_fields()})

    def quantized_tensor_of(self, buffers) -> QuantizedTensor:
        """The weight this Linear would hold with ``buffers`` ({weight buffer name: tensor of its stored shape},
        e.g. one expert's slice of stacked buffers) as a ``QuantizedTensor`` (shares them)."""
        layout = format_of(self.weight_spec).layout(self.weight_spec, (self.out_features, self.in_features))
        fields = {field: buffers[name].reshape(layout[field][0] if field in layout else ())
                  for name, (field, _) in self._weight_fields().items()}
        return QuantizedTensor(spec=self.weight_spec, shape=torch.Size((self.out_features, self.in_features)),
                               dtype=self._dtype, **fields)

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dequantized weight in FP32 (the format's ``dequantize``), cast to ``dtype`` (default: the
        layer's dtype); cached until a weight buffer changes."""
        dtype = dtype or self._dtype
        bufs = [getattr(self, n) for n in self._weight_fields()]
        key = (dtype, bufs[0].device, *((b._version, b.data_ptr()) for b in bufs))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.quantized_weight().dequantize(dtype))
        return self._cache[1]

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The inputs the GEMM reads (weights-only: x)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized_weight(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(straight_through(x, self.quantize_input), w, b)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the bias only, never the codes and scales."""
        self._cache = None
        return keep_buffer_dtypes(self, super()._apply, fn, recurse)


__all__ = ["GLOBAL_SCALE", "QuantizedInferenceLinear", "keep_buffer_dtypes", "weight_buffers"]
