"""``method="autoround"``: AutoRound (sign-SGD on rounding offsets and clip factors, each decoder layer's
output reconstructed on the calibration set) for NVFP4, FP8 and MX weights.

Per decoder layer (``quantize_model`` asks ``reconstruct_layer`` once the statistics are recorded): every
Linear starts from what round to nearest gives it with its scheme's scale rule and its fused group's
shared scale ("6", "4over6", "sweep", or the Hessian-aware rules when the scheme asks for them), then the
layer's Linears are learned together (``reconstruct``), and each one is stored from its learned rounding
(``grid``): its latent weight ``W + V * g`` rounded with its learned scales, kept as the latent for scale
learning. Fused 3-D MoE experts (the standard layout of Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, and gpt-oss's)
are learned with the layer, every expert's projections on their own grids (W4A4: through the layout's eager
routing loop with each expert's inputs quantized).
"""
from __future__ import annotations

from ....errors import UsageError
from ....quant import MX, NVFP4
from ...fused_experts import ExpertsStart
from ...protocol import PTQMethod, QuantizedWeight
from .grid import make_grid
from .options import AutoRoundOptions
from .reconstruct import ExpertsLearner, LinearLearner, reconstruct

class AutoRound(PTQMethod):
    """Learns each decoder layer's weight rounding and block-scale clipping (see the module docstring)."""

    name = "autoround"
    Options = AutoRoundOptions
    flag_prefix = "autoround"
    reconstructs_layers = True
    quantizes_fused_experts = True

    def check_scheme(self, name: str, scheme) -> None:
        spec = scheme.weight_spec
        if spec is None:
            return
        if getattr(spec, "rounding", "nearest") != "nearest":
            raise UsageError(f"{name}: method='autoround' rounds to nearest; its scheme {scheme.label!r} asks for "
                             f"rounding={spec.rounding!r}")
        if isinstance(spec, NVFP4) and spec.block_2d:
            raise UsageError(f"{name}: method='autoround' learns 1x16 NVFP4 blocks; its scheme {scheme.label!r} "
                             "has 16x16 blocks (block_2d): use another method for it")
        if isinstance(spec, MX) and spec.dim not in (-1, 1):
            raise UsageError(f"{name}: method='autoround' learns MX blocks along the input features; its scheme "
                             f"{scheme.label!r} has dim={spec.dim}")

    def reconstruct_layer(self, layer, inputs, device, start):
        modules = {id(m): rel for rel, m in layer.module.named_modules()}
        learners = []
        for n, sw in start.items():
            if isinstance(sw, ExpertsStart):
                module = layer.experts[n]
                try:
                    learners.append(ExpertsLearner(modules[id(module)], module, sw, self.options.clip_scales))
                except ValueError as err:
                    raise UsageError(f"{n}: {err}") from err
                continue
            lin = layer.linears[n]
            try:
                grid = make_grid(lin.weight.to(device), sw.q.to(device))
            except ValueError as err:
                raise UsageError(f"{n}: {err}") from err
            quantize_input = sw.scheme.input_quantizer(sw.input_amax) if sw.scheme.quantizes_activations else None
            key = layer.stats[n].name if layer.stats is not None else n
            learners.append(LinearLearner(modules[id(lin)], lin, grid, self.options.clip_scales, quantize_input, key))
        states, figures = reconstruct(layer.module, learners, inputs, device, self.options)
        results = {}
        for ln, state in zip(learners, states):
            results.update(ln.results(state))
        return results, figures


__all__ = ["AutoRound"]
