"""What a checkpoint must hold, from a meta-device build of the model its config describes, and the
checks of the stored tensors against it (names, dtypes, shapes, then values), made before anything
is allocated. Each quantized Linear has the ``ModuleScheme`` the format's config gives it and is read
by the format's codec for it (``codecs``: expected tensors, stored-value checks, the scales siblings
share); KV-cache scales are named by the format's ``KVScales``."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..nn.kv_cache import attention_modules
from .common import CheckpointError, tied_targets
from ..nn.experts_layouts import supported_experts_layout
from ..quant import format_of
from .experts import Family, expert_linear_names, family_of, hub_name, memory_name
from .files import Shards
from ..quant.schemes import scheme_row
from . import schema
from .codecs import codec_for
from .ct_transforms import read_rotation, resolve
from .module_schemes import ModuleRules, ModuleScheme
from .registry import CheckpointFormat, ParsedConfig
from .shared_scales import check_shared_scales, sibling_groups
from .tensor_kinds import kind_of
from .validate import check_finite, check_positive

KV_WHICH = ("k_scale", "v_scale")
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class QLinear:
    in_features: int
    out_features: int
    bias: bool
    scheme: ModuleScheme
    rules: ModuleRules


@dataclass(frozen=True)
class QExperts:
    """A fused-experts module stored as per-expert quantized Linears (NVFP4, FP8 or MX): ``linears``
    [(expert, "gate" | "up" | "down" | gpt-oss "gate_up", on-disk Linear name)], its scheme and rules (one
    for all of them)."""

    experts: int
    hidden: int
    intermediate: int
    scheme: ModuleScheme
    rules: ModuleRules
    linears: tuple
    kept: tuple = ()  # the module's own tensors stored as they are (its layout's biases: gpt-oss)


@dataclass
class Plan:
    quantized: dict  # on-disk module name -> QLinear (per-expert Linears of ``experts`` included)
    expected_q: dict  # tensor name -> (module, on-disk suffix, allowed dtypes, allowed shapes)
    plain: dict  # tensor name -> (dtype, shape)
    model_bytes: int
    kv: dict = field(default_factory=dict)  # tensor name -> (attention module, "k_scale" | "v_scale", shapes)
    kv_granularity: Optional[str] = None
    experts: dict = field(default_factory=dict)  # in-memory experts module name -> QExperts
    family: Optional[Family] = None  # with experts: the hub naming of every on-disk name
    high_experts: dict = field(default_factory=dict)  # in-memory name -> its per-expert high-precision Linears
    rotations: dict = field(default_factory=dict)  # on-disk module name -> (TransformGroup, size, matrix key)

    def rotation_of(self, shards: Shards, name: str):
        """The validated online rotation of module ``name`` (``ct_transforms.read_rotation``)."""
        group, size, key = self.rotations[name]
        try:
            return read_rotation(group, size, shards.get(key), key)
        except ValueError as e:
            raise CheckpointError(f"{shards.path(key)}: {name}: {e}") from None

    def memory(self, name: str) -> str:
        """The in-memory name of an on-disk module / tensor name (not of per-expert Linears)."""
        return memory_name(name, self.family)

    def disk(self, name: str) -> str:
        """The on-disk name of an in-memory module / tensor name."""
        return hub_name(name, self.family)


def _unshared(model: nn.Module) -> dict[str, torch.Tensor]:
    """The meta model's state without tied copies (what ``drop_shared`` keeps on a real model)."""
    state = model.state_dict(keep_vars=True)
    targets = tied_targets(model)
    by_id: dict[int, list[str]] = defaultdict(list)
    for k, t in state.items():
        by_id[id(t)].append(k)
    drop = set()
    for names in by_id.values():
        keep = ([n for n in names if n not in targets] or names)[:1]
        drop.update(n for n in names if n not in keep)
    return {k: t for k, t in state.items() if k not in drop}


def _rules(name: str, s: ModuleScheme, bs: dict) -> ModuleRules:
    return kind_of(s).rules(name, s, bs)


def _kv_heads(attn: nn.Module, cfg: dict) -> int:
    head_dim = getattr(attn, "head_dim", None)
    n = attn.k_proj.out_features
    if isinstance(head_dim, int) and head_dim > 0 and n % head_dim == 0:
        return n // head_dim
    return int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 1)


def _experts(model: nn.Module, parsed: ParsedConfig, bs: dict, config_path: Path,
             present: Optional[set]) -> tuple[dict, Optional[Family], dict]:
    """The fused-experts modules the config quantizes (as per-expert Linears under the family's hub
    names): {in-memory name: QExperts}, the family (None when no experts module is stored per expert) and
    the high-precision experts modules stored per expert ({in-memory name: their hub Linear names}: what
    exports of known families with the experts excluded write). A module whose fused 3-D
    ``gate_up_proj`` is among the stored tensors (``present``) is a high-precision one stored fused
    under in-memory names (older exports)."""
    fused = {n: m for n, m in model.named_modules() if supported_experts_layout(m) is not None}
    if not fused:
        return {}, None, {}
    try:
        fam = family_of(model)
    except ValueError:
        return {}, None, {}  # unknown family: its experts stay the model's own (high-precision) tensors
    out, high = {}, {}
    for name, m in fused.items():
        if present is not None and f"{name}.gate_up_proj" in present:
            continue
        layout = supported_experts_layout(m)
        E, H, I = layout.dims(m)
        two_i = 2 * I
        lin = expert_linear_names(hub_name(name, fam), E, fam)
        got = {n: parsed.scheme_of(n) for _, _, n in lin}
        schemes = {s for s in got.values() if s is not None}
        if not schemes:
            if present is not None and all(f"{n}.weight" in present for _, _, n in lin):
                high[name] = tuple(n for _, _, n in lin)
            continue
        if len(schemes) > 1 or None in got.values():
            listing = ", ".join(f"{n}: {s.label if s is not None else 'high precision'}"
                                for n, s in list(got.items())[:6])
            raise CheckpointError(f"{config_path}: fused MoE experts {name}: the config gives its per-expert Linears "
                                  f"different schemes ({listing}, ...); blockscale loads every expert of a layer with "
                                  "one scheme")
        s = schemes.pop()
        block = scheme_row(s.name).block_size
        if block and (H % block or (two_i // 2) % block):
            raise CheckpointError(f"{config_path}: fused MoE experts {name}: hidden {H} / intermediate {two_i // 2} "
                                  f"not multiples of {block}, so they cannot be {s.name}")
        row = scheme_row(s.name)
        spec = row.weight(row.defaults())
        g = format_of(spec).scale_rows(spec)  # weight rows per scale row (128x128-block FP8: 128)
        if g > 1 and not layout.interleaved and (two_i // 2) % g:
            raise CheckpointError(f"{config_path}: fused MoE experts {name}: intermediate {two_i // 2} is not a multiple "
                                  f"of {g}, so its gate and up cannot be {s.name} Linears of one expert (a scale covers "
                                  f"{g} rows)")
        rules = {_rules(n, s, bs) for _, _, n in lin}
        if len(rules) > 1:
            raise CheckpointError(f"{config_path}: fused MoE experts {name}: quantization_config.blockscale gives its "
                                  "per-expert Linears different activation rules; one per experts module is supported")
        out[name] = QExperts(E, H, two_i // 2, s, rules.pop(), tuple(lin), tuple(layout.biases.values()))
    return out, (fam if out or high else None), high


def build_plan(model: nn.Module, parsed: ParsedConfig, bs: dict, fmt: CheckpointFormat, config_path: Path,
               cfg: dict, present: Optional[set] = None) -> Plan:
    """``present``: the stored tensor names (fused experts stored as 3-D tensors stay high precision)."""
    experts, fam, high_experts = _experts(model, parsed, bs, config_path, present)
    quantized: dict[str, QLinear] = {}
    for mem_name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        name = hub_name(mem_name, fam)
        s = parsed.scheme_of(name)
        if s is None:
            continue
        block = scheme_row(s.name).block_size
        if block and m.in_features % block:
            raise CheckpointError(f"{config_path}: {name}: in_features={m.in_features} is not a multiple of {block}, so "
                                  f"it cannot be {kind_of(s).block_noun(s)}; the quantization config should list it in "
                                  "ignore / exclude_modules")
        quantized[name] = QLinear(m.in_features, m.out_features, m.bias is not None, s, _rules(name, s, bs))
    for qe in experts.values():
        for _, p, n in qe.linears:
            k, out = (qe.hidden, qe.intermediate) if p != "down" else (qe.intermediate, qe.hidden)
            if p == "gate_up":  # gpt-oss: one Linear for the expert's interleaved gate / up rows
                out = 2 * qe.intermediate
            quantized[n] = QLinear(k, out, False, qe.scheme, qe.rules)
    expected_q = {}
    for name, q in quantized.items():
        want = codec_for(fmt, q.scheme, name).expected(q.scheme, q.out_features, q.in_features)
        for suffix, (dts, shapes) in want.items():
            expected_q[f"{name}.{suffix}"] = (name, suffix, tuple(dts), tuple(tuple(s) for s in shapes))
    plain = {}
    for k, t in _unshared(model).items():
        mod, _, leaf = k.rpartition(".")
        disk = hub_name(k, fam)
        if (mod in experts and leaf not in experts[mod].kept) or (disk.rpartition(".")[0] in quantized and
                                                                  leaf != "bias"):
            continue
        if mod in high_experts:  # stored per expert: [I, H] gate / up rows, [H, I] down
            if leaf == "gate_up_proj":
                E, two_i, H = t.shape
                for (_, p, n) in expert_linear_names(hub_name(mod, fam), E, fam):
                    plain[f"{n}.weight"] = (t.dtype, (H, two_i // 2) if p == "down" else (two_i // 2, H))
            continue
        plain[disk] = (t.dtype, tuple(t.shape))
    kv = {}
    if parsed.kv:
        for attn_name, attn in attention_modules(model).items():
            shapes = tuple(tuple(s) for s in fmt.kv.shapes(parsed.kv, _kv_heads(attn, cfg)))
            for which, key in zip(KV_WHICH, fmt.kv.names(attn_name)):
                kv[key] = (attn_name, which, shapes)
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return Plan(quantized, expected_q, plain, sum(seen.values()), kv, parsed.kv, experts, fam, high_experts,
                _rotations(model, parsed, fam, present, config_path))


def _rotations(model: nn.Module, parsed: ParsedConfig, fam, present: Optional[set], config_path: Path) -> dict:
    """{on-disk module name: (TransformGroup, size, matrix key)} of the online transforms: Linear inputs and
    attention modules' queries / keys (R3)."""
    if not parsed.transforms:
        return {}
    linears = {hub_name(n, fam): m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    attns = {n: (int(getattr(m, "head_dim", 0) or 0), type(m).__name__) for n, m in attention_modules(model).items()}
    try:
        return resolve(parsed.transforms, linears, set(present or ()), "quantization_config.transform_config",
                       attns)
    except schema.ConfigError as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def _list(names, k=8) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _describe(plan: Plan) -> str:
    kinds = {kind_of(q.scheme) for q in plan.quantized.values()}
    if len(kinds) == 1 and not plan.kv and next(iter(kinds)).summary is not None:
        w4a4 = any(q.scheme.inputs for q in plan.quantized.values())
        return f"{'W4A4' if w4a4 else 'W4A16'}, {len(plan.quantized)} {next(iter(kinds)).noun} Linears"
    names = sorted({q.scheme.name for q in plan.quantized.values()})
    kv = ", NVFP4 KV-cache scales per layer" if plan.kv_granularity == "nvfp4" else \
        f", FP8 KV-cache scales per {'layer' if plan.kv_granularity == 'tensor' else 'head'}" if plan.kv else ""
    return f"{' + '.join(names)}, {len(plan.quantized)} quantized Linears{kv}"


def _dtypes(dts) -> str:
    return " or ".join(str(d) for d in dts)


def check_plan(plan: Plan, shards: Shards, root: Path, fmt_name: str, explicit: bool) -> None:
    """Names, dtypes and shapes of every expected tensor against the headers."""
    present = set(shards.infos)
    expected = set(plan.expected_q) | set(plan.plain) | set(plan.kv) | {k for _, _, k in plan.rotations.values()}
    missing, unexpected = expected - present, present - expected
    if missing or unexpected:
        msg = [f"{root}: the tensors do not match the config ({fmt_name}, {_describe(plan)})"]
        if missing:
            msg.append(f"missing: {_list(missing)}")
        if unexpected:
            msg.append(f"unexpected: {_list(unexpected)}")
        raise CheckpointError("; ".join(msg))
    for key in sorted(expected):
        t, f = shards.infos[key], shards.path(key)
        if key not in plan.expected_q and key not in plan.kv and key not in plan.plain:
            continue  # a rotation matrix: checked by check_values
        if key in plan.expected_q or key in plan.kv:
            dts, shapes = plan.expected_q[key][2:] if key in plan.expected_q else (KV_DTYPES, plan.kv[key][2])
            if t.dtype not in dts or t.shape not in set(shapes):
                want = " or ".join(str(list(s)) for s in shapes)
                raise CheckpointError(f"{f}: tensor {key!r}: {t.dtype} {list(t.shape)}, expected {_dtypes(dts)} {want}")
            continue
        dt, shape = plan.plain[key]
        if t.shape != shape:
            raise CheckpointError(f"{f}: tensor {key!r}: shape {list(t.shape)}, the config implies {list(shape)}")
        if t.dtype != dt and not (explicit and t.dtype.is_floating_point and dt.is_floating_point):
            raise CheckpointError(f"{f}: tensor {key!r}: {t.dtype}, expected {dt} (the model dtype; pass dtype= to "
                                  "cast)")


def _check_modules(plan: Plan, shards: Shards, fmt: CheckpointFormat) -> None:
    """Each quantized Linear's stored values, as its codec checks them."""
    for name, q in plan.quantized.items():
        codec_for(fmt, q.scheme, name).check_stored(q.scheme, name, q.out_features, q.in_features,
                                                    lambda suf: shards.view(f"{name}.{suf}"),
                                                    lambda suf: shards.path(f"{name}.{suf}"))


def _check_siblings_shared(plan: Plan, shards: Shards, fmt: CheckpointFormat, root: Path) -> None:
    """Fused siblings hold the stored scales their codec says they share (NVFP4: the outer scales)."""
    share = {n: codec_for(fmt, q.scheme, n).siblings_share(q.scheme) for n, q in plan.quantized.items()}
    suffixes = list(dict.fromkeys(s for sufs in share.values() for s in sufs))
    groups = sibling_groups([n for n, sufs in share.items() if sufs])
    try:
        for suf in suffixes:
            check_shared_scales({n: shards.view(f"{n}.{suf}") for n, sufs in share.items() if suf in sufs}, suf,
                                groups)
    except ValueError as e:
        raise CheckpointError(f"{root}: {e}") from None


def _check_experts_shared(plan: Plan, shards: Shards, fmt: CheckpointFormat, root: Path) -> None:
    """Gate and up of every expert carry the same stored per-tensor scales, bit for bit
    (the codec's ``experts_share``: NVFP4 outer and input scales, FP8 per-tensor scales): vLLM's NVFP4 MoE loaders keep only the gate's (w13_*[:, 0]) and would
    run the up rows with it; blockscale runs gate and up as one GEMM with one scale."""
    for name, qe in plan.experts.items():
        lin = {(e, p): n for e, p, n in qe.linears}
        if (0, "gate") not in lin:  # gpt-oss: gate and up are one stored Linear
            continue
        for e in range(qe.experts):
            g, u = lin[(e, "gate")], lin[(e, "up")]
            for suf in codec_for(fmt, qe.scheme, name).experts_share(qe.scheme):
                a, b = shards.view(f"{g}.{suf}"), shards.view(f"{u}.{suf}")
                if not torch.equal(a.reshape(-1).to(torch.float32).view(torch.int32),
                                   b.reshape(-1).to(torch.float32).view(torch.int32)):
                    va, vb = float(a.reshape(-1)[0]), float(b.reshape(-1)[0])
                    raise CheckpointError(
                        f"{shards.path(f'{u}.{suf}')}: fused MoE experts {plan.disk(name)}, expert {e}: gate "
                        f"{g}.{suf}={va!r} and up {u}.{suf}={vb!r} differ; the expert's gate and up run as one GEMM "
                        "with one scale (vLLM's NVFP4 MoE loaders keep the gate's), so they must be equal")


def check_values(plan: Plan, shards: Shards, fmt: CheckpointFormat, root: Path) -> None:
    """Every stored value (see ``validate``), fused NVFP4 siblings sharing their outer scales."""
    _check_modules(plan, shards, fmt)
    for key in plan.kv:
        check_positive(key, shards.view(key), shards.path(key))
    for key in plan.plain:
        check_finite(key, shards.view(key), shards.path(key))
    _check_experts_shared(plan, shards, fmt, root)
    _check_siblings_shared(plan, shards, fmt, root)
    for name in plan.rotations:
        plan.rotation_of(shards, name)


__all__ = ["Plan", "QLinear", "build_plan", "check_plan", "check_values"]
