"""NVFP4Experts: the NVFP4 inference replacement of a transformers fused-experts module (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3 routed experts: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] 3-D parameters,
``forward(hidden_states, top_k_index, top_k_weights)``).

Each expert e has its own NVFP4 weights: the gate/up rows [2I, H] share one FP32 outer encode scale
(serving engines load gate and up of one expert as one GEMM), the down rows [H, I] have their own.
W4A4 adds one calibrated input encode scale per expert and projection (gate/up input, down input).

Forward: W4A16 runs the replaced class's own forward (whatever ``config._experts_implementation``
dispatches to: eager loop, grouped_mm, ...) on the dequantized weights, so the output equals that of
the original module holding those weights bit for bit. W4A4 runs the transformers eager routing loop
(same operations, same order) with each expert's inputs fake-quantized to NVFP4 (dynamic per-16
block scales, the expert's calibrated outer scale) before its gate/up and its down GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..quant import NVFP4, QuantizedTensor, fake_quantize
from ..quant.nvfp4 import INPUT_SCALE_RULES
from .fp8_linear import keep_buffer_dtypes

#: the fused-experts classes of transformers >= 5 known to have the layout above (checked anyway)
KNOWN_FUSED_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts",
                       "DeepseekV3Experts")
#: fused-experts classes that are not this layout, with the reason (``fused_experts_layout``). gpt-oss has
#: its own class, ``nn.nvfp4_gpt_oss_experts.NVFP4GptOssExperts`` (PTQ, export and load use it).
UNSUPPORTED_FUSED_EXPERTS = {
    "GptOssExperts": ("gpt-oss experts (gate_up_proj [E, H, 2I] transposed with gate / up columns interleaved, "
                      "gate_up_proj_bias / down_proj_bias, a clamped GLU) are not the standard fused layout; they have "
                      "their own classes (PTQ: NVFP4GptOssExperts, blockscale.nn.nvfp4_gpt_oss_experts; convert: "
                      "QuantizedGptOssExperts, blockscale.nn.hf_experts)"),
}
_FUSED_PARAMS = ("gate_up_proj", "down_proj")
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_PROJ = ("gate_up", "down")


def has_fused_expert_parameters(module: nn.Module) -> bool:
    """True when ``module`` owns a 3-D floating-point ``gate_up_proj`` or ``down_proj`` parameter."""
    return any(p is not None and p.is_floating_point() and p.dim() == 3
               for k, p in module._parameters.items() if k in _FUSED_PARAMS)


def fused_experts_layout(module: nn.Module) -> Optional[str]:
    """Why ``module`` (fused 3-D expert parameters) cannot become an ``NVFP4Experts``, or None when it can:
    exactly the parameters gate_up_proj [E, 2I, H] and down_proj [E, H, I] (concatenated gate;up rows,
    not transposed, no biases), no buffers, an ``act_fn`` and ``num_experts`` = E."""
    if type(module).__name__ in UNSUPPORTED_FUSED_EXPERTS:
        return UNSUPPORTED_FUSED_EXPERTS[type(module).__name__]
    params = {k: p for k, p in module._parameters.items() if p is not None}
    if set(params) != set(_FUSED_PARAMS):
        return f"parameters {sorted(params)}; the supported layout has exactly gate_up_proj and down_proj"
    gu, dn = params["gate_up_proj"], params["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3:
        return f"gate_up_proj {tuple(gu.shape)}, down_proj {tuple(dn.shape)}: expected 3-D tensors"
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(dn.shape) != (E, H, two_i // 2):
        return (f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)}: expected [E, 2I, H] and "
                "[E, H, I]")
    if any(b is not None for b in module._buffers.values()):
        return f"buffers {sorted(module._buffers)}; the supported layout has none"
    flags = dict(is_transposed=False, is_concatenated=True, has_bias=False, has_gate=True, has_post_expert_norm=False)
    bad = [k for k, v in flags.items() if getattr(module, k, v) != v]
    if bad:
        return f"{', '.join(f'{k}={getattr(module, k)!r}' for k in bad)}; the supported layout has {flags}"
    if getattr(module, "num_experts", E) != E or not callable(getattr(module, "act_fn", None)):
        return "expected num_experts == gate_up_proj.shape[0] and an act_fn"
    return None


def shell_of(module: nn.Module) -> nn.Module:
    """A parameterless copy of ``module`` (same class, attributes and child modules) whose forward runs on
    the tensors put into its ``gate_up_proj`` / ``down_proj`` attributes."""
    cls = type(module)
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    for k, v in vars(module).items():
        if k not in _MODULE_INTERNALS:
            shell.__dict__[k] = v
    shell._modules = dict(module._modules)
    shell.training = False
    return shell


def hf_experts_forward(shell: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The replaced class's own forward (``shell``: ``shell_of`` it) run on the weights gate_up [E, 2I, H] /
    down [E, H, I]."""
    shell.__dict__["gate_up_proj"], shell.__dict__["down_proj"] = gate_up, down
    try:
        return type(shell).forward(shell, hidden_states, top_k_index, top_k_weights)
    finally:
        del shell.__dict__["gate_up_proj"], shell.__dict__["down_proj"]


def eager_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, act_fn, num_experts: int, quantize_input) -> torch.Tensor:
    """The transformers eager routing loop (MixtralExperts.forward) on gate_up [E, 2I, H] / down [E, H, I],
    each expert's gate/up input and down input passed through ``quantize_input(x, proj, expert)``."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        e = int(expert_idx)
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = quantize_input(hidden_states[token_idx], "gate_up", e)
        gate, up = nn.functional.linear(current_state, gate_up[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = quantize_input(act_fn(gate) * up, "down", e)
        current_hidden_states = nn.functional.linear(current_hidden_states, down[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def stacked_dequantized(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]): ``module.quantized_weight(proj, e).dequantize(dtype)`` stacked over
    the experts, cached in ``module._cache`` until one of its weight buffers (``*_weight*``) changes."""
    bufs = [b for k, b in module.named_buffers(recurse=False) if "_weight" in k]
    key = (dtype, bufs[0].device, tuple(b._version for b in bufs), tuple(b.data_ptr() for b in bufs))
    if module._cache is None or module._cache[0] != key:
        out = tuple(torch.stack([module.quantized_weight(p, e).dequantize(dtype) for e in range(module.num_experts)])
                    for p in _PROJ)
        module._cache = (key, out)
    return module._cache[1]


def check_expert_counts(E: int, gate_up: list, down: list, gate_up_input_scale, down_input_scale,
                        input_scale_rule) -> None:
    """ValueError unless there are E quantized experts per projection and, for W4A4 (``input_scale_rule``
    set), both input scales (none of them for W4A16)."""
    if len(gate_up) != E or len(down) != E:
        raise ValueError(f"expected {E} quantized experts per projection, got {len(gate_up)} and {len(down)}")
    if (gate_up_input_scale is None) != (input_scale_rule is None) or \
            (down_input_scale is None) != (input_scale_rule is None):
        raise ValueError("W4A4 needs both input scales and input_scale_rule (or none of them for W4A16)")


class NVFP4Experts(nn.Module):
    """Fused MoE experts with NVFP4 weights, one outer scale per expert and projection.

    Buffers (P = gate_up [2I rows, H inputs] or down [H rows, I inputs]): ``{P}_weight_packed`` uint8
    [E, rows, inputs/2], ``{P}_weight_scale`` float8_e4m3fn [E, rows, inputs/16], ``{P}_weight_global_scale``
    FP32 [E] (S_e: x^ = q * s * (1/S_e)); W4A4: ``{P}_input_global_scale`` FP32 [E].
    H and I must be multiples of 16.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *, act_fn=None,
                 input_scale_rule: Optional[str] = None, input_error: str = "mse",
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if hidden_dim % 16 or intermediate_dim % 16:
            raise ValueError(f"hidden_dim={hidden_dim}, intermediate_dim={intermediate_dim}: NVFP4 experts need "
                             "multiples of 16 (one E4M3 scale per 16 inputs)")
        if input_scale_rule is not None and input_scale_rule not in INPUT_SCALE_RULES:
            raise ValueError(f"input_scale_rule={input_scale_rule!r}; allowed values: None (W4A16), "
                             f"{', '.join(map(repr, INPUT_SCALE_RULES))}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.input_scale_rule, self.input_error = input_scale_rule, input_error
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        E = num_experts
        for p, (rows, k) in zip(_PROJ, ((2 * intermediate_dim, hidden_dim), (hidden_dim, intermediate_dim))):
            self.register_buffer(f"{p}_weight_packed", torch.zeros(E, rows, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{p}_weight_scale", torch.zeros(E, rows, k // 16, dtype=torch.float8_e4m3fn,
                                                                  device=device))
            self.register_buffer(f"{p}_weight_global_scale", torch.ones(E, dtype=torch.float32, device=device))
            if input_scale_rule is not None:
                self.register_buffer(f"{p}_input_global_scale", torch.ones(E, dtype=torch.float32, device=device))
        self._dtype = dtype
        self._cache: Optional[tuple] = None
        self.__dict__["_hf_shell"] = None  # not a submodule: no parameters, not in named_modules

    @property
    def scheme_name(self) -> str:
        return "nvfp4-w4a16" if self.input_scale_rule is None else "nvfp4-w4a4"

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the forward runs the dequantized weights in (the replaced module's)."""
        return self._dtype

    @property
    def weight_elements(self) -> int:
        """Elements of the weights this module stands for: E * (2I*H + H*I)."""
        return 3 * self.num_experts * self.intermediate_dim * self.hidden_dim

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_experts(cls, module: nn.Module, gate_up: list[QuantizedTensor], down: list[QuantizedTensor], *,
                     gate_up_input_scale: Optional[torch.Tensor] = None,
                     down_input_scale: Optional[torch.Tensor] = None, input_scale_rule: Optional[str] = None,
                     input_error: str = "mse") -> "NVFP4Experts":
        """Replace the fused-experts ``module`` (``fused_experts_layout`` must accept it): ``gate_up[e]`` /
        ``down[e]`` are expert e's NVFP4 weights [2I, H] / [H, I], each with one outer scale (gate and up
        share theirs since they are one tensor). W4A4: ``*_input_scale`` [E] encode scales and the rule."""
        why = fused_experts_layout(module)
        if why is not None:
            raise ValueError(f"{type(module).__name__}: {why}")
        E, two_i, H = module.gate_up_proj.shape
        check_expert_counts(E, gate_up, down, gate_up_input_scale, down_input_scale, input_scale_rule)
        m = cls(E, H, two_i // 2, act_fn=module.act_fn, input_scale_rule=input_scale_rule, input_error=input_error,
                dtype=module.gate_up_proj.dtype, device=module.gate_up_proj.device)
        m.fill_weights(gate_up, down, gate_up_input_scale, down_input_scale)
        m.__dict__["_hf_shell"] = shell_of(module)
        return m

    @torch.no_grad()
    def fill_weights(self, gate_up: list[QuantizedTensor], down: list[QuantizedTensor],
                     gate_up_input_scale: Optional[torch.Tensor] = None,
                     down_input_scale: Optional[torch.Tensor] = None) -> None:
        """Copy expert e's NVFP4 weights ``gate_up[e]`` / ``down[e]`` (one outer scale each, shaped like
        this module's rows x inputs) and, W4A4, the [E] input encode scales into the buffers."""
        for p, qs in zip(_PROJ, (gate_up, down)):
            packed = getattr(self, f"{p}_weight_packed")
            want = tuple(packed.shape[1:-1]) + (2 * packed.shape[-1],)
            for e, q in enumerate(qs):
                if not isinstance(q.spec, NVFP4) or tuple(q.shape) != want:
                    raise ValueError(f"{p} expert {e}: expected an NVFP4 QuantizedTensor of shape {want}, got {q!r}")
                if q.outer_scale.numel() != 1:
                    raise ValueError(f"{p} expert {e}: one outer scale per expert expected")
                packed[e].copy_(q.codes)
                getattr(self, f"{p}_weight_scale")[e].copy_(q.scales)
                getattr(self, f"{p}_weight_global_scale")[e] = q.outer_scale.reshape(())
        if self.input_scale_rule is not None:
            self.gate_up_input_global_scale.copy_(gate_up_input_scale.reshape(self.num_experts))
            self.down_input_global_scale.copy_(down_input_scale.reshape(self.num_experts))

    def quantized_weight(self, proj: str, expert: int) -> QuantizedTensor:
        """Expert ``expert``'s weight of ``proj`` ("gate_up" or "down") as a QuantizedTensor (shares the buffers)."""
        if proj not in _PROJ:
            raise ValueError(f"proj={proj!r}: expected 'gate_up' or 'down'")
        codes = getattr(self, f"{proj}_weight_packed")[expert]
        S = getattr(self, f"{proj}_weight_global_scale")[expert]
        return QuantizedTensor(spec=NVFP4(), codes=codes, scales=getattr(self, f"{proj}_weight_scale")[expert],
                               shape=torch.Size((codes.shape[0], 2 * codes.shape[1])), dtype=self._dtype,
                               outer_scale=S)

    def dequantized(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]): x^ = (q * s) * (1/S_e) per expert, in ``dtype`` (default the
        replaced module's dtype); cached until a buffer changes."""
        return stacked_dequantized(self, dtype or self._dtype)

    def quantize_input(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        """W4A4: x fake-quantized to NVFP4 with expert ``expert``'s calibrated ``proj`` input scale; else x."""
        if self.input_scale_rule is None:
            return x
        spec = NVFP4(scale_rule=self.input_scale_rule, error=self.input_error)
        enc = getattr(self, f"{proj}_input_global_scale")[expert]
        return fake_quantize(x, spec, encode_scale=enc, check_finite=False)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # weights in the input's dtype (the replaced module's, unless the model was cast since: .to(bfloat16))
        return self.forward_with(hidden_states, top_k_index, top_k_weights, *self.dequantized(hidden_states.dtype))

    def forward_with(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, quantize_input=None) -> torch.Tensor:
        """The forward on the given (e.g. differentiable) weights gate_up [E, 2I, H] / down [E, H, I] in place
        of the stored ones; W4A4: ``quantize_input(x, proj, expert)`` in place of ``self.quantize_input``
        (scale learning passes a straight-through version of it). ``forward`` = this on ``dequantized()``."""
        shell = self._hf_shell
        if self.input_scale_rule is None and shell is not None:
            return hf_experts_forward(shell, hidden_states, top_k_index, top_k_weights, gate_up, down)
        return self._eager(hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input)

    def _eager(self, hidden_states, top_k_index, top_k_weights, gate_up, down, quantize_input=None) -> torch.Tensor:
        return eager_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, self.act_fn, self.num_experts,
                             quantize_input or self.quantize_input)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` never casts the codes and scales (gpt-oss biases follow the model dtype)."""
        self._cache = None
        return keep_buffer_dtypes(self, super()._apply, fn, recurse, follow=("gate_up_proj_bias", "down_proj_bias"))

    def extra_repr(self) -> str:
        act = "W4A16" if self.input_scale_rule is None else f"W4A4 (activations scale_rule={self.input_scale_rule})"
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, {act}")


__all__ = ["KNOWN_FUSED_EXPERTS", "NVFP4Experts", "UNSUPPORTED_FUSED_EXPERTS", "check_expert_counts", "eager_experts",
           "fused_experts_layout", "has_fused_expert_parameters", "hf_experts_forward", "shell_of",
           "stacked_dequantized"]
