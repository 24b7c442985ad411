"""QuantizedExperts: the one quantized replacement of a transformers fused-experts module, for every stored
scheme (NVFP4, FP8, MX, any registered format with a ``QuantizedInferenceLinear``) and every ``ExpertsLayout``
(standard fused, gpt-oss; ``nn.experts_layouts``).

Each expert e and projection P (gate_up: [2I, H], gate and up rows as ONE weight, so a per-tensor scale is
shared by gate and up, as serving engines run them in one GEMM; down: [H, I]) holds exactly what that
scheme's inference Linear of the matrix holds, stacked over experts: buffer ``{P}_{b}`` of shape
[E] + the Linear's ``b`` (its ``stacked_flat`` one-element buffers as [E]), e.g.

    nvfp4  {P}_weight_packed uint8 [E, rows, K/2], {P}_weight_scale e4m3 [E, rows, K/16],
           {P}_weight_global_scale FP32 [E]; W4A4 {P}_input_global_scale FP32 [E]
    fp8    {P}_weight float8_e4m3fn [E, rows, K]; {P}_weight_scale FP32 tensor [E, 1], channel [E, rows, 1],
           block [E, ceil(rows/128), ceil(K/128)]; static activations {P}_input_scale FP32 [E, 1]
    mx     {P}_weight (MXFP8) or {P}_weight_packed (MXFP4); {P}_weight_scale uint8 [E, rows, K/32]

plus the layout's high-precision biases (gpt-oss ``gate_up_proj_bias`` [E, 2I] / ``down_proj_bias`` [E, H]
in the module's dtype). ``expert_linear(P, e)`` is the Linear of expert e (a copy); the module computes with
views of the stacked buffers as those Linears (``_expert_view``), so expert e's GEMM is that Linear's.

Forward: weights only runs the replaced class's own forward (``layout.forward``) on the dequantized weights, bit
for bit that of the original module holding them; with activations quantized it runs the layout's routing loop
(``layout.eager``) with each expert's gate/up and down input quantized as that expert's Linear quantizes its
input. ``NVFP4Experts``, ``NVFP4GptOssExperts`` and ``SchemeExperts`` are this class under their load-compatible
names and constructors (``class_for``).
"""
from __future__ import annotations

import weakref
from typing import ClassVar, Optional

import torch
from torch import nn

from ..quant import QuantizedTensor
from ..quant.schemes import stored_scheme_name
from .experts_layout import shell_of
from .experts_layouts import experts_layout_named, experts_layout_of
from .quantized_linear import QuantizedInferenceLinear, keep_buffer_dtypes

PROJECTIONS = ("gate_up", "down")
#: per module: (proj, expert) -> (ids of the stacked buffers, that expert's view Linear); outside the module
#: so that its attributes stay plain (streaming PTQ records them)
_VIEWS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class QuantizedExperts(nn.Module):
    """Fused MoE experts, every expert's GEMMs one stored scheme (see the module docstring).

    stored: (kind, weights, inputs) as ``quant.schemes`` names them; rules: what it does not say
    ({"input_scale_rule", "input_error", "scale_rule"}); layout: an ``ExpertsLayout`` name ("fused", "gpt-oss").
    """

    #: adapters: the stored kinds and layouts they are the class of (``class_for``)
    experts_kinds: ClassVar[tuple] = ()
    experts_layouts: ClassVar[tuple] = ()
    _by_key: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for k in cls.experts_kinds:
            for lay in cls.experts_layouts:
                QuantizedExperts._by_key.setdefault((k, lay), cls)

    @staticmethod
    def class_for(kind: str, layout: str) -> type:
        """The (load-compatible) class of experts of a stored kind in ``layout``; QuantizedExperts itself for
        a kind no adapter names."""
        return QuantizedExperts._by_key.get((kind, layout), QuantizedExperts)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, stored: tuple, *,
                 rules: Optional[dict] = None, layout: str = "fused", act_fn=None, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        lay = experts_layout_named(layout)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.stored, self.layout_name = tuple(stored), layout
        rules = dict(rules or {})
        self.input_scale_rule = rules.get("input_scale_rule") if stored[2] is not None else None
        self.input_error, self.scale_rule = rules.get("input_error", "mse"), rules.get("scale_rule", "ceil")
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        self._dtype = dtype
        E = num_experts
        # the rules as the Linears hold them (defaults filled in: an NVFP4 W4A4 rule "6")
        for k, v in self._empty_linear(*self._shape("gate_up"), device="meta").rules.items():
            setattr(self, k, v)
        # an empty Linear (meta device) per projection checks the arguments and gives the per-expert buffers,
        # initial values as the Linear's (codes 0, FP32 scales 1, UE8M0 / E4M3 block scales 0)
        for p in PROJECTIONS:
            proto = self._empty_linear(*self._shape(p), device="meta")
            for b, t in proto.named_buffers(recurse=False):
                if t is None:
                    continue
                fill = type(proto).initial_values.get(b, 1.0 if t.dtype == torch.float32 else 0)
                shape = (E,) if b in type(proto).stacked_flat else (E,) + tuple(t.shape)
                self.register_buffer(f"{p}_{b}", torch.full(shape, fill, dtype=t.dtype, device=device))
        for p, name in lay.biases.items():
            self.register_buffer(name, torch.zeros(E, self._shape(p)[0], dtype=dtype, device=device))
        self._cache: Optional[tuple] = None
        self.__dict__["_hf_shell"] = None  # not a submodule: no parameters, not in named_modules

    # -- what it is ------------------------------------------------------------------------------
    @property
    def layout(self):
        """Its ``ExpertsLayout``."""
        return experts_layout_named(self.layout_name)

    @property
    def rules(self) -> dict:
        """The rules its Linears are built with (``QuantizedInferenceLinear.empty``)."""
        return {"input_scale_rule": self.input_scale_rule, "input_error": self.input_error,
                "scale_rule": self.scale_rule}

    @property
    def scheme_name(self) -> str:
        return stored_scheme_name(*self.stored)

    @property
    def quantizes_inputs(self) -> bool:
        return self.stored[2] is not None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the module it replaced (its forward runs in the input's)."""
        return self._dtype

    @property
    def weight_elements(self) -> int:
        """Elements of the weights this module stands for: E * (2I*H + H*I)."""
        return 3 * self.num_experts * self.intermediate_dim * self.hidden_dim

    def _shape(self, proj: str) -> tuple[int, int]:
        """(rows, inputs) of one expert's ``proj`` matrix."""
        I, H = self.intermediate_dim, self.hidden_dim
        if proj not in PROJECTIONS:
            raise ValueError(f"proj={proj!r}: expected 'gate_up' or 'down'")
        return (2 * I, H) if proj == "gate_up" else (H, I)

    def _empty_linear(self, rows: int, k: int, device=None) -> QuantizedInferenceLinear:
        """An empty Linear of one expert's [rows, k] GEMM (the class of this module's stored kind)."""
        return QuantizedInferenceLinear.class_for(self.stored[0]).empty(
            self.stored, k, rows, rules=self.rules, dtype=self._dtype, device=device)

    def _expert_view(self, proj: str, expert: int) -> QuantizedInferenceLinear:
        """Expert ``expert``'s ``proj`` GEMM as a Linear whose buffers are views of this module's (no copy);
        kept (the eager forward asks for it per expert and call) until a stacked buffer is replaced."""
        stacked = tuple((n, t) for n, t in self._buffers.items() if n.startswith(f"{proj}_") and t is not None)
        key = tuple(id(t) for _, t in stacked)
        views = _VIEWS.setdefault(self, {})
        hit = views.get((proj, expert))
        if hit is not None and hit[0] == key:
            return hit[1]
        lin = self._empty_linear(*self._shape(proj), device="meta")
        for b, t in lin._buffers.items():
            if t is not None:
                lin._buffers[b] = getattr(self, f"{proj}_{b}")[expert].reshape(t.shape)
        views[(proj, expert)] = (key, lin)  # (the views keep the stacked tensors alive: ids are not reused)
        return lin

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def replacing(cls, module: nn.Module, stored: tuple, rules: dict, device=None) -> "QuantizedExperts":
        """Empty experts of ``module``'s sizes and layout (ValueError when no layout accepts it) under
        ``stored``, of the class ``class_for`` names (``cls`` when it is QuantizedExperts' subclass already)."""
        lay = experts_layout_of(module)
        why = "no known fused-experts layout claims it" if lay is None else lay.why_not(module)
        if why is not None:
            raise ValueError(f"{type(module).__name__}: {why}")
        klass = QuantizedExperts.class_for(stored[0], lay.name) if cls is QuantizedExperts else cls
        if lay.name not in (klass.experts_layouts or (lay.name,)):
            raise ValueError(f"{type(module).__name__}: {klass.__name__} replaces the layouts "
                             f"{list(klass.experts_layouts)}, not {lay.name!r}")
        E, H, I = lay.dims(module)
        m = klass.__new__(klass)
        QuantizedExperts.__init__(m, E, H, I, stored, rules=rules, layout=lay.name, act_fn=getattr(module, "act_fn", None),
                                  dtype=module.gate_up_proj.dtype, device=device)
        return m

    @torch.no_grad()
    def adopt(self, module: nn.Module) -> "QuantizedExperts":
        """Take ``module``'s high-precision biases (unless it is on the meta device: loading fills them) and
        keep a parameterless copy of it to run its forward with; returns self."""
        for name in self.layout.biases.values():
            src = getattr(module, name)
            if src.device.type != "meta":
                getattr(self, name).copy_(src.detach())
        self.__dict__["_hf_shell"] = shell_of(module)
        return self

    @classmethod
    def from_linears(cls, module: nn.Module, gate_up: list, down: list) -> "QuantizedExperts":
        """Replace the fused-experts ``module`` by the experts whose GEMMs are ``gate_up[e]`` ([2I, H] in the
        layout's row order, e.g. gpt-oss's gate_up_proj[e]^T) and ``down[e]`` ([H, I]): quantized inference
        Linears without bias, all of one stored scheme and rules. ValueError for anything else."""
        E = len(gate_up)
        if E == 0 or len(down) != E:
            raise ValueError(f"expected one gate_up and one down Linear per expert, got {len(gate_up)} and {len(down)}")
        lins = list(gate_up) + list(down)
        bad = next((m for m in lins if not isinstance(m, QuantizedInferenceLinear)), None)
        if bad is not None:
            raise ValueError(f"expected quantized inference Linears, got {type(bad).__name__}")
        schemes = {(m.stored, tuple(sorted(m.rules.items()))) for m in lins}
        if len(schemes) != 1:
            raise ValueError(f"the experts' Linears have different schemes: {sorted(map(str, schemes))}")
        if any(m.bias is not None for m in lins):
            raise ValueError("the experts' Linears must not have a bias (gpt-oss biases are the module's own)")
        stored, rules = schemes.pop()
        m = cls.replacing(module, stored, dict(rules), device=gate_up[0].codes.device)
        if m.num_experts != E:
            raise ValueError(f"expected {m.num_experts} quantized experts per projection, got {E}")
        m.fill_linears(gate_up, down)
        return m.adopt(module)

    @torch.no_grad()
    def fill_linears(self, gate_up: list, down: list) -> None:
        """Copy expert e's tensors from the Linears ``gate_up[e]`` / ``down[e]`` (this module's scheme and shapes)."""
        for p, lins in zip(PROJECTIONS, (gate_up, down)):
            rows, k = self._shape(p)
            for e, lin in enumerate(lins):
                if (lin.out_features, lin.in_features) != (rows, k):
                    raise ValueError(f"{p} expert {e}: a ({lin.out_features}, {lin.in_features}) Linear, expected "
                                     f"({rows}, {k})")
                view = self._expert_view(p, e)
                for b, t in lin.named_buffers(recurse=False):
                    if t is not None:
                        view._buffers[b].copy_(t)

    def expert_linear(self, proj: str, expert: int, rows: Optional[slice] = None) -> QuantizedInferenceLinear:
        """Expert ``expert``'s ``proj`` GEMM as its scheme's Linear holding a copy of its tensors, or of its rows
        ``rows`` only (e.g. the up rows ``slice(I, 2I)``; ``QuantizedTensor.rows`` refuses a cut through a
        scale's row group, such as an FP8 128x128 tile). Bias-free (gpt-oss biases are the module's)."""
        N, K = self._shape(proj)
        r = range(N)[rows] if rows is not None else range(N)
        if r.step != 1 or not len(r):
            raise ValueError(f"rows={rows!r}: expected a non-empty contiguous slice of the {N} rows")
        view = self._expert_view(proj, expert)
        q = view.quantized_weight()
        if len(r) != N:
            q = q.rows(r.start, r.stop)
        # copies of the tensors themselves, each on its own device (streaming PTQ's skeleton keeps the small
        # scales real and the codes on the meta device; the export reads the former)
        lin = self._empty_linear(len(r), K, device="meta")
        fields = lin._weight_fields()
        for b, (field, shape) in fields.items():
            lin._buffers[b] = getattr(q, field).detach().reshape(shape).clone()
        for b, t in view._buffers.items():
            if t is not None and b not in fields:  # the input scales: one per expert and projection
                lin._buffers[b] = t.detach().clone()
        return lin

    # -- weights and inputs ----------------------------------------------------------------------
    def quantized_weight(self, proj: str, expert: int) -> QuantizedTensor:
        """Expert ``expert``'s ``proj`` weight as a QuantizedTensor (shares the buffers)."""
        return self._expert_view(proj, expert).quantized_weight()

    def dequantized(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) dequantized per expert, in ``dtype`` (default the replaced
        module's); cached until a weight buffer changes."""
        dtype = dtype or self._dtype
        bufs = [b for k, b in self.named_buffers(recurse=False) if "_weight" in k]
        key = (dtype, bufs[0].device, tuple(b._version for b in bufs), tuple(b.data_ptr() for b in bufs))
        if self._cache is None or self._cache[0] != key:
            out = tuple(torch.stack([self.quantized_weight(p, e).dequantize(dtype) for e in range(self.num_experts)])
                        for p in PROJECTIONS)
            self._cache = (key, out)
        return self._cache[1]

    def quantize_input(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        """x as expert ``expert``'s ``proj`` Linear quantizes its input (with the expert's calibrated input scale
        where it has one); x itself for weights-only schemes."""
        if not self.quantizes_inputs:
            return x
        return self._expert_view(proj, expert).quantize_input(x)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # weights in the input's dtype (the replaced module's, unless the model was cast since: .to(bfloat16))
        return self.forward_with(hidden_states, top_k_index, top_k_weights, *self.dequantized(hidden_states.dtype))

    def forward_with(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, quantize_input=None) -> torch.Tensor:
        """The forward on the given (e.g. differentiable) weights gate_up [E, 2I, H] / down [E, H, I] in place
        of the stored ones; with quantized inputs ``quantize_input(x, proj, expert)`` in place of
        ``self.quantize_input`` (scale learning passes a straight-through version of it)."""
        if not self.quantizes_inputs and self._hf_shell is not None:
            return self.layout.forward(self, hidden_states, top_k_index, top_k_weights, gate_up, down)
        return self._eager(hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input)

    def _eager(self, hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input=None) -> torch.Tensor:
        """The layout's routing loop on the given weights."""
        return self.layout.eager(self, hidden_states, top_k_index, top_k_weights, gate_up, down,
                                 quantize_input or self.quantize_input)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the layout's biases (the model dtype), never the codes and scales."""
        self._cache = None
        _VIEWS.pop(self, None)
        return keep_buffer_dtypes(self, super()._apply, fn, recurse, follow=tuple(self.layout.biases.values()))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, {self.scheme_name}, layout {self.layout_name}")


__all__ = ["PROJECTIONS", "QuantizedExperts"]
