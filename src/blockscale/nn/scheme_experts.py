"""SchemeExperts: fused MoE experts under an FP8 or MX PTQ scheme (the FP8 / MX counterpart of
``NVFP4Experts``; transformers' fused layout gate_up_proj [E, 2I, H] / down_proj [E, H, I], or gpt-oss's
transposed one, stored as its out x in matrices like ``NVFP4GptOssExperts``).

Each expert e and projection P (gate_up: [2I, H], gate and up rows as ONE weight, so a per-tensor FP8
scale is shared by gate and up, as serving engines run them in one GEMM; down: [H, I]) holds exactly
what an ``FP8Linear`` / ``MXLinear`` of that matrix holds, stacked over experts:

    fp8  {P}_weight float8_e4m3fn [E, rows, K]; {P}_weight_scale FP32: tensor [E, 1], channel [E, rows, 1],
         block [E, ceil(rows/128), ceil(K/128)]; static activations {P}_input_scale FP32 [E, 1]
    mx   {P}_weight float8_e4m3fn [E, rows, K] (MXFP8) or {P}_weight_packed uint8 [E, rows, K/2] (MXFP4);
         {P}_weight_scale uint8 [E, rows, K/32] (UE8M0)

so ``expert_linear(P, e)`` (an FP8Linear / MXLinear holding a copy of expert e's tensors) computes
exactly what expert e's GEMM computes here. gpt-oss adds the biases ``gate_up_proj_bias`` [E, 2I] /
``down_proj_bias`` [E, H] in the module's dtype.

Forward: weights only (fp8-w8a16, mxfp4-w4a16, mxfp8-w8a16) runs the replaced class's own forward on the
dequantized weights (bit for bit that of the original module holding them); with activations quantized
it runs the transformers eager loop with each expert's gate/up input and down input quantized as that
expert's ``FP8Linear`` / ``MXLinear`` quantizes its input (static FP8 with the expert's calibrated
input scale, dynamic per-token / 1x128 FP8, dynamic per-32 MX).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from ..quant import QuantizedTensor
from .fp8_linear import FP8Linear
from .mx_linear import MXLinear
from .quantized_linear import QuantizedInferenceLinear, keep_buffer_dtypes
from .nvfp4_experts import eager_experts, hf_experts_forward, shell_of, stacked_dequantized
from .nvfp4_gpt_oss_experts import eager_gpt_oss_experts, gpt_oss_forward

_PROJ = ("gate_up", "down")
#: per module: (proj, expert) -> (ids of the stacked buffers, that expert's view Linear); outside the module
#: so that its attributes stay plain (streaming PTQ records them)
_VIEWS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
SCHEME_EXPERT_KINDS = ("fp8", "mx")


def _scheme_of_linear(m: nn.Module) -> tuple:
    if isinstance(m, (FP8Linear, MXLinear)):
        return (*m.stored, getattr(m, "scale_rule", "ceil"))
    raise ValueError(f"expected an FP8Linear or MXLinear, got {type(m).__name__}")


class SchemeExperts(nn.Module):
    """Fused MoE experts with FP8 or MX weights, one scheme for every expert (see the module docstring).

    kind "fp8": ``weights`` = FP8 weight granularity ("tensor", "channel", "block"), ``inputs`` = None /
    "tensor" (static) / "token" / "block"; kind "mx": ``weights`` = element ("e4m3", "e2m1"), ``inputs`` =
    None or that element, ``scale_rule`` the activations' MX scale rule. ``gpt_oss``: the experts replace a
    transformers ``GptOssExperts`` (biases, clamped GLU, gate/up rows interleaved).
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, kind: str, weights: str,
                 inputs: Optional[str] = None, *, scale_rule: str = "ceil", act_fn=None, gpt_oss: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if kind not in SCHEME_EXPERT_KINDS:
            raise ValueError(f"kind={kind!r}; allowed values: {', '.join(map(repr, SCHEME_EXPERT_KINDS))}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.kind, self.weights, self.inputs, self.scale_rule = kind, weights, inputs, scale_rule
        self.gpt_oss = gpt_oss
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        E = num_experts
        # an empty Linear (meta device) per projection checks the arguments and gives the per-expert buffers;
        # initial values as FP8Linear / MXLinear's: codes 0, FP32 scales 1, UE8M0 scales 127 (2**0)
        for p, (rows, k) in zip(_PROJ, ((2 * intermediate_dim, hidden_dim), (hidden_dim, intermediate_dim))):
            proto = self._empty_linear(rows, k, device="meta")
            for b, t in proto.named_buffers(recurse=False):
                if t is None:
                    continue
                fill = type(proto).initial_values.get(b, 1.0 if t.dtype == torch.float32 else 0)
                self.register_buffer(f"{p}_{b}", torch.full((E,) + tuple(t.shape), fill, dtype=t.dtype, device=device))
        if gpt_oss:
            self.register_buffer("gate_up_proj_bias", torch.zeros(E, 2 * intermediate_dim, dtype=dtype, device=device))
            self.register_buffer("down_proj_bias", torch.zeros(E, hidden_dim, dtype=dtype, device=device))
        self._dtype = dtype
        self._cache: Optional[tuple] = None
        self.__dict__["_hf_shell"] = None

    def _empty_linear(self, rows: int, k: int, device=None) -> QuantizedInferenceLinear:
        """An empty Linear of one expert's [rows, k] GEMM (the class of this module's kind)."""
        return QuantizedInferenceLinear.class_for(self.kind).empty(
            (self.kind, self.weights, self.inputs), k, rows, rules={"scale_rule": self.scale_rule},
            dtype=getattr(self, "_dtype", torch.float32), device=device)

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
                lin._buffers[b] = getattr(self, f"{proj}_{b}")[expert]
        views[(proj, expert)] = (key, lin)  # (the views keep the stacked tensors alive: ids are not reused)
        return lin

    # -- what it is ------------------------------------------------------------------------------
    @property
    def scheme_name(self) -> str:
        return self._empty_linear(32, 32, device="meta").scheme_name

    @property
    def quantizes_inputs(self) -> bool:
        return self.inputs is not None

    @property
    def weight_elements(self) -> int:
        """E * (2I*H + H*I)."""
        return 3 * self.num_experts * self.intermediate_dim * self.hidden_dim

    def _shape(self, proj: str) -> tuple[int, int]:
        I, H = self.intermediate_dim, self.hidden_dim
        return (2 * I, H) if proj == "gate_up" else (H, I)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_linears(cls, module: nn.Module, gate_up: list, down: list, *, gpt_oss: bool = False) -> "SchemeExperts":
        """Replace the fused-experts ``module`` by the experts whose GEMMs are ``gate_up[e]`` ([2I, H]: gate then
        up rows; gpt-oss: gate_up_proj[e]^T, rows interleaved) and ``down[e]`` ([H, I]): FP8Linear / MXLinear
        modules without bias, all of one scheme. gpt-oss: the biases are copied from ``module`` (unless it is
        on the meta device). ValueError for anything else."""
        E = len(gate_up)
        if E == 0 or len(down) != E:
            raise ValueError(f"expected one gate_up and one down Linear per expert, got {len(gate_up)} and {len(down)}")
        schemes = {_scheme_of_linear(m) for m in list(gate_up) + list(down)}
        if len(schemes) != 1:
            raise ValueError(f"the experts' Linears have different schemes: {sorted(schemes)}")
        if any(m.bias is not None for m in list(gate_up) + list(down)):
            raise ValueError("the experts' Linears must not have a bias (gpt-oss biases are the module's own)")
        kind, weights, inputs, scale_rule = schemes.pop()
        two_i, H = gate_up[0].out_features, gate_up[0].in_features
        if two_i % 2:
            raise ValueError(f"gate_up has {two_i} rows; expected 2 * intermediate")
        src = module.gate_up_proj
        m = cls(E, H, two_i // 2, kind, weights, inputs, scale_rule=scale_rule,
                act_fn=None if gpt_oss else module.act_fn, gpt_oss=gpt_oss, dtype=src.dtype,
                device=gate_up[0].weight_scale.device)
        m.fill_linears(gate_up, down)
        if gpt_oss and module.gate_up_proj_bias.device.type != "meta":
            with torch.no_grad():
                m.gate_up_proj_bias.copy_(module.gate_up_proj_bias.detach())
                m.down_proj_bias.copy_(module.down_proj_bias.detach())
        m.__dict__["_hf_shell"] = shell_of(module)
        return m

    @torch.no_grad()
    def fill_linears(self, gate_up: list, down: list) -> None:
        """Copy expert e's tensors from the Linears ``gate_up[e]`` / ``down[e]`` (this module's scheme and shapes)."""
        for p, lins in zip(_PROJ, (gate_up, down)):
            rows, k = self._shape(p)
            for e, lin in enumerate(lins):
                if (lin.out_features, lin.in_features) != (rows, k):
                    raise ValueError(f"{p} expert {e}: a ({lin.out_features}, {lin.in_features}) Linear, expected "
                                     f"({rows}, {k})")
                for b, t in lin.named_buffers(recurse=False):
                    if t is not None:
                        getattr(self, f"{p}_{b}")[e].copy_(t)

    def expert_linear(self, proj: str, expert: int, rows: Optional[slice] = None) -> nn.Module:
        """Expert ``expert``'s ``proj`` GEMM as an FP8Linear / MXLinear holding a copy of its tensors, or of its
        rows ``rows`` only (e.g. the up rows ``slice(I, 2I)``: a block-scaled FP8 weight needs them on a 128-row
        tile boundary). Bias-free (gpt-oss biases are the module's)."""
        if proj not in _PROJ:
            raise ValueError(f"proj={proj!r}: expected 'gate_up' or 'down'")
        N, K = self._shape(proj)
        r = range(N)[rows] if rows is not None else range(N)
        if r.step != 1 or not len(r):
            raise ValueError(f"rows={rows!r}: expected a non-empty contiguous slice of the {N} rows")
        lin = self._empty_linear(len(r), K, device=getattr(self, f"{proj}_weight_scale").device)
        tile = self.kind == "fp8" and self.weights == "block"
        if tile and (r.start % 128 or (r.stop % 128 and r.stop != N)):
            raise ValueError(f"rows {r.start}:{r.stop} of a 128x128-block FP8 weight: not on 128-row tile boundaries")
        with torch.no_grad():
            for b, t in lin.named_buffers(recurse=False):
                if t is None:
                    continue
                src = getattr(self, f"{proj}_{b}")[expert]
                if b == "weight_scale" and tile:
                    src = src[r.start // 128:-(-r.stop // 128)]
                elif b != "input_scale" and not (b == "weight_scale" and self.weights == "tensor"):
                    src = src[r.start:r.stop]
                t.copy_(src.reshape(t.shape))
        return lin

    # -- weights and inputs ----------------------------------------------------------------------
    def quantized_weight(self, proj: str, expert: int) -> QuantizedTensor:
        """Expert ``expert``'s ``proj`` weight as a QuantizedTensor (as that expert's Linear's
        ``quantized_weight()``; shares the buffers)."""
        return self._expert_view(proj, expert).quantized_weight()

    def dequantized(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) dequantized per expert, in ``dtype`` (default the replaced
        module's); cached until a buffer changes."""
        return stacked_dequantized(self, dtype or self._dtype)

    def quantize_input(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        """x as expert ``expert``'s ``proj`` Linear quantizes its input (``FP8Linear.quantize_input`` /
        ``MXLinear.quantize_input``, with the expert's static input scale where it has one); x itself for
        weights-only schemes."""
        if self.inputs is None:
            return x
        return self._expert_view(proj, expert).quantize_input(x)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shell = self._hf_shell
        if shell is None:
            raise ValueError("SchemeExperts needs the experts module it replaces (build it with from_linears)")
        gate_up, down = self.dequantized(hidden_states.dtype)  # as FP8Linear / MXLinear: the input's dtype
        if self.gpt_oss:
            biases = (self.gate_up_proj_bias, self.down_proj_bias)
            if not self.quantizes_inputs:
                return gpt_oss_forward(shell, hidden_states, top_k_index, top_k_weights, gate_up, down, *biases)
            return eager_gpt_oss_experts(shell, hidden_states, top_k_index, top_k_weights, gate_up, down, *biases,
                                         self.num_experts, self.quantize_input)
        if not self.quantizes_inputs:
            return hf_experts_forward(shell, hidden_states, top_k_index, top_k_weights, gate_up, down)
        return eager_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, self.act_fn, self.num_experts,
                             self.quantize_input)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the gpt-oss biases (the model dtype), never the codes and scales."""
        self._cache = None
        _VIEWS.pop(self, None)
        return keep_buffer_dtypes(self, super()._apply, fn, recurse, follow=("gate_up_proj_bias", "down_proj_bias"))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, {self.scheme_name} ({self.kind} {self.weights}, "
                f"inputs {self.inputs or 'none'}){', gpt-oss' if self.gpt_oss else ''}")


__all__ = ["SCHEME_EXPERT_KINDS", "SchemeExperts"]
