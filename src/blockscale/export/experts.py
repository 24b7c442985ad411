"""Quantized fused MoE experts (``QuantizedExperts``: NVFP4Experts, SchemeExperts, ...) in checkpoints: per-expert Linears
under the names the
family's Hugging Face checkpoints use (what transformers >= 5 ``save_pretrained`` writes, its weight
conversion reversed), which is what vLLM / SGLang's MoE loaders read.

transformers 5 (``conversion_mapping.py``) fuses the hub's per-expert Linears on load:
- Mixtral: ``.block_sparse_moe.`` is renamed ``.mlp.`` (every key: router and experts), and
  ``experts.{e}.w1`` / ``w3`` (gate / up) become ``experts.gate_up_proj`` [E, 2I, H] (gate rows first),
  ``experts.{e}.w2`` (down) ``experts.down_proj`` [E, H, I];
- Qwen2-MoE / Qwen3-MoE / OLMoE (the ``qwen2_moe`` mapping): ``mlp.experts.{e}.gate_proj`` / ``up_proj`` ->
  ``mlp.experts.gate_up_proj``, ``mlp.experts.{e}.down_proj`` -> ``mlp.experts.down_proj``.

Export reverses that: each expert e of NVFP4 experts (``NVFP4Experts``) at ``<m>`` is written as three NVFP4 Linears
``<hub m>.{e}.<gate>`` [I, H], ``<hub m>.{e}.<up>`` [I, H] (both with the expert's one gate/up outer
scale, and W4A4 its one gate/up input scale) and ``<hub m>.{e}.<down>`` [H, I]; every other key of the
model gets the family's renaming (Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``). The per-expert
Linears are ordinary NVFP4 Linears to the rest of the export (``ExpertsView.linears``): config
groups / ``quantized_layers``, fused gate/up groups sharing their scales, the report. Loading
(``load_plan``) rebuilds the experts from them. Experts of any scheme are written the same way, their
per-expert Linears copies of the expert's rows (``QuantizedExperts.expert_linear``).

Fused experts kept in high precision (excluded) in a model of a known family are written the same way,
as save_pretrained writes them: per-expert ``<hub m>.{e}.<gate|up|down>.weight`` in the model's dtype
(``ExpertsView.high``), the experts module and each of its per-expert Linears listed in ``ignore`` /
``exclude_modules`` (vLLM's compressed-tensors MoE method probes ``<m>.0.gate_proj`` / ``.0.up_proj`` /
``.0.down_proj`` against ``ignore``, its ModelOpt one ``<m>`` against ``exclude_modules``); loading stacks
them back into ``gate_up_proj`` / ``down_proj``. Models of other families are written as before
(in-memory names).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..nn.experts_layout import has_fused_expert_parameters
from ..nn.fused_experts_layout import fused_experts_layout
from ..nn.quantized_experts import QuantizedExperts
from .module_schemes import buffers, scheme_of

#: the quantized fused-experts modules the export writes per expert
QUANTIZED_EXPERTS = (QuantizedExperts,)


@dataclass(frozen=True)
class Family:
    """How one model family's hub checkpoints name its experts: ``rename`` (in-memory substring, hub
    substring) applied to every key, or None; ``leaves`` (gate, up, down) per-expert Linear names."""

    rename: Optional[tuple[str, str]]
    leaves: tuple[str, str, str]
    fused_gate_up: bool = False  # gpt-oss: one per-expert gate_up Linear (leaves[0]) and down (leaves[2])


_QWEN = Family(None, ("gate_proj", "up_proj", "down_proj"))
#: config.model_type -> Family (checked against save_pretrained in tests/export/test_export_fused_experts.py)
FAMILIES = {
    "mixtral": Family((".mlp.", ".block_sparse_moe."), ("w1", "w3", "w2")),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "olmoe": _QWEN,
    "deepseek_v3": _QWEN,  # routed experts (DeepseekV3Experts); shared_experts are plain Linears
    # gpt-oss (NVFP4GptOssExperts): <m>.{e}.gate_up_proj [2I, H] (rows interleaved as in gate_up_proj's columns)
    # and <m>.{e}.down_proj [H, I]; no engine loads this NVFP4 layout (docs/formats.md)
    "gpt_oss": Family(None, ("gate_up_proj", "gate_up_proj", "down_proj"), fused_gate_up=True),
}


#: the per-expert names vLLM's CompressedTensorsMoEMethod.get_moe_method asks the config about to decide
#: whether a MoE layer is quantized (compressed_tensors_moe.py: "<experts>.0.gate_proj", ...), for every family
VLLM_CT_PROBES = ("gate_proj", "up_proj", "down_proj")


def family_of(model: nn.Module) -> Family:
    """The ``Family`` of ``model`` (ValueError naming the supported model types otherwise)."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    fam = FAMILIES.get(mt)
    if fam is None:
        raise ValueError(f"model_type={mt!r}: quantized fused MoE experts can be stored for the model types "
                         f"{', '.join(sorted(FAMILIES))} only (their hub checkpoints' per-expert names are known)")
    return fam


def hub_name(name: str, fam: Optional[Family]) -> str:
    """The hub (on-disk) form of an in-memory module or tensor name."""
    if fam is None or fam.rename is None:
        return name
    mem, hub = fam.rename
    return f".{name}.".replace(mem, hub)[1:-1]


def memory_name(name: str, fam: Optional[Family]) -> str:
    """The in-memory form of a hub name (inverse of ``hub_name`` on the names it produces)."""
    if fam is None or fam.rename is None:
        return name
    mem, hub = fam.rename
    return f".{name}.".replace(hub, mem)[1:-1]


def expert_linear_names(hub_module: str, E: int, fam: Family) -> list[tuple[int, str, str]]:
    """[(expert, "gate" | "up" | "down", hub Linear name)] of an experts module at ``hub_module``;
    gpt-oss (``fam.fused_gate_up``): [(expert, "gate_up" | "down", name)]."""
    g, u, d = fam.leaves
    if fam.fused_gate_up:
        return [(e, p, f"{hub_module}.{e}.{leaf}") for e in range(E) for p, leaf in (("gate_up", g), ("down", d))]
    return [(e, p, f"{hub_module}.{e}.{leaf}") for e in range(E) for p, leaf in (("gate", g), ("up", u), ("down", d))]


def split_experts(hub_module: str, gate_up: torch.Tensor, down: torch.Tensor, fam: Family) -> dict:
    """{``<hub_module>.{e}.<leaf>.weight``: expert e's gate rows gate_up[e, :I], up rows gate_up[e, I:] or
    down_proj[e]} (views) of fused high-precision experts, in ``expert_linear_names`` order."""
    I = gate_up.shape[1] // 2
    rows = {"gate": lambda e: gate_up[e, :I], "up": lambda e: gate_up[e, I:], "down": lambda e: down[e]}
    return {f"{lin}.weight": rows[p](e) for e, p, lin in expert_linear_names(hub_module, gate_up.shape[0], fam)}


@dataclass
class ExpertsView:
    """The model as the export writes it when it holds quantized fused experts: ``family``; ``modules``
    (in-memory experts module name -> QuantizedExperts); ``linears`` (hub per-expert Linear name
    -> its scheme's quantized Linear holding a copy of that expert's rows, in model order)."""

    family: Family
    modules: dict
    linears: dict
    high: dict = field(default_factory=dict)  # in-memory name -> fused experts module kept in high precision
    kept: tuple = ()  # leaves of the quantized experts modules written as they are (their layout's biases: gpt-oss)

    def hub(self, name: str) -> str:
        return hub_name(name, self.family)

    def high_linears(self, name: str) -> list[str]:
        """The hub per-expert Linear names of the high-precision experts module ``name`` (in-memory)."""
        m = self.high[name]
        return [n for _, _, n in expert_linear_names(self.hub(name), m.gate_up_proj.shape[0], self.family)]

    def ignore_names(self, name: str) -> list[str]:
        """What ``ignore`` / ``exclude_modules`` lists for the high-precision experts module ``name``: its hub
        name, every per-expert Linear, and the names vLLM's compressed-tensors MoE method probes whatever the
        family's leaves (``<m>.0.gate_proj`` / ``.0.up_proj`` / ``.0.down_proj``; Mixtral's are w1 / w3 / w2)."""
        own = self.high_linears(name)
        probes = [f"{self.hub(name)}.0.{leaf}" for leaf in VLLM_CT_PROBES]
        return [self.hub(name)] + own + [p for p in probes if p not in own]

    def state(self, state: dict) -> dict:
        """``state`` (in-memory keys) without the experts' buffers, keys in hub form, plus every
        per-expert Linear's buffers; high-precision fused experts split per expert (copies)."""
        out = {}
        for k, t in state.items():
            mod, _, leaf = k.rpartition(".")
            if mod in self.modules:
                if leaf in self.kept:
                    out[self.hub(k)] = t
                continue
            if mod in self.high:
                if leaf == "gate_up_proj":
                    split = split_experts(self.hub(mod), t, state[f"{mod}.down_proj"], self.family)
                    out.update({n: v.clone() for n, v in split.items()})
                continue
            out[self.hub(k)] = t
        for n, m in self.linears.items():
            for b in buffers(scheme_of(m)):
                out[f"{n}.{b}"] = getattr(m, b)
        return out


    def report(self) -> dict:
        """{hub experts module: its in-memory name, E / H / I, scheme ("high precision" for excluded ones),
        per-expert Linear leaves} for the report."""
        g, u, d = self.family.leaves
        leaves = {"gate_up": g, "down": d} if self.family.fused_gate_up else {"gate": g, "up": u, "down": d}
        out = {self.hub(n): {"module": n, "experts": m.num_experts, "hidden": m.hidden_dim,
                             "intermediate": m.intermediate_dim, "scheme": m.scheme_name,
                             "linears": leaves, **({"tensors": list(self.kept)} if self.kept else {})}
               for n, m in self.modules.items()}
        for n, m in self.high.items():
            E, two_i, H = m.gate_up_proj.shape
            out[self.hub(n)] = {"module": n, "experts": E, "hidden": H, "intermediate": two_i // 2,
                                "scheme": "high precision", "linears": {"gate": g, "up": u, "down": d}}
        return out


def experts_view(model: nn.Module) -> Optional[ExpertsView]:
    """The ``ExpertsView`` of ``model``, or None when it has neither ``QuantizedExperts`` nor (in a model of a
    family in ``FAMILIES``) high-precision fused experts or a family renaming (a Mixtral whose experts are
    per-expert nn.Linear modules, the transformers-4 layout, gets its hub names too). ValueError when it
    has QuantizedExperts and its family is not supported or some fused experts modules stay in high precision
    next to quantized ones."""
    modules = {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_EXPERTS)}
    if not modules:
        fam = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
        high = fused_experts_modules(model)
        if fam is None or (not high and fam.rename is None):
            return None
        return ExpertsView(fam, {}, {}, high)  # (no experts module: the family's renaming, as save_pretrained)
    fam = family_of(model)
    high = [n for n, m in model.named_modules() if has_fused_expert_parameters(m)]
    if high:
        raise ValueError(f"{high[0]} ({len(high)} fused MoE experts module(s)) is in high precision while "
                         f"{next(iter(modules))} is quantized: exporting a model whose fused experts are partly quantized "
                         "is not supported; quantize every experts module or none")
    linears = {}
    for name, ex in modules.items():
        I = ex.intermediate_dim
        rows = {"gate": slice(0, I), "up": slice(I, 2 * I), "down": slice(None), "gate_up": slice(None)}
        if ex.layout.interleaved != fam.fused_gate_up:
            raise ValueError(f"{name}: {type(ex).__name__} in a model_type={model.config.model_type!r} model: "
                             "not the experts layout of that family")
        for e, p, lin in expert_linear_names(hub_name(name, fam), ex.num_experts, fam):
            linears[lin] = ex.expert_linear("down" if p == "down" else "gate_up", e, rows[p])
    kept = dict.fromkeys(b for ex in modules.values() for b in ex.layout.biases.values())
    return ExpertsView(fam, modules, linears, kept=tuple(kept))


# ---- loading ---------------------------------------------------------------------------------------
def fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """In-memory name -> every module of ``model`` (a meta-device build works) with the fused layout
    ``NVFP4Experts`` replaces."""
    return {n: m for n, m in model.named_modules()
            if has_fused_expert_parameters(m) and fused_experts_layout(m) is None}


__all__ = ["ExpertsView", "FAMILIES", "QUANTIZED_EXPERTS", "Family", "expert_linear_names", "experts_view", "family_of",
           "fused_experts_modules", "hub_name", "memory_name", "split_experts", "VLLM_CT_PROBES"]
