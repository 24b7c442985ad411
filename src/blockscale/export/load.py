"""load_checkpoint / checkpoint_format: read an NVFP4 checkpoint back into a transformers model whose
quantized Linears are ``NVFP4Linear`` (logits equal the exported model's bit for bit).

Which format a checkpoint is comes from the one detector (``models.checkpoint_detection``, fed by the
registered formats); everything format-specific (config parsing, tensor names, reading a layer, the
decode scale) is a field of its ``CheckpointFormat`` (``registry``), so nothing here names a format.

A checkpoint is untrusted input. In order, before anything is allocated: every file read resolves
inside the directory (``files``); config fields are type-checked and bounded (``schema``, the format's
``parse_config``); the safetensors headers are parsed; config sizes are compared with the header shapes; the
architecture is built on the meta device and every expected tensor's name, dtype and shape compared
with the headers; then block scales, outer / input scales and plain tensors are validated and fused
siblings' scales compared (``validate``), and the SHA-256 digests our exports record are verified
(unless ``verify=False``). Only then is the model built and filled.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..errors import UsageError
from ..models.checkpoint_detection import detected_format, file_inside
from ..nn.nvfp4_linear import NVFP4Linear
from . import schema
from .common import FORMATS, CheckpointError, drop_shared, tied_targets
from .files import Shards, checkpoint_dir, inside, read_json
from .registry import CheckpointFormat, QuantScheme
from .shared_scales import check_shared_scales, sibling_groups
from .validate import (check_block_scales, check_decode_range, check_finite, check_model_bytes, check_outer_scale,
                       check_sizes, verify_digests)

CONFIG_FILE = "config.json"
LOAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _format(root: Path, cfg: dict) -> CheckpointFormat:
    """The registered format that claims the checkpoint (``models.checkpoint_detection``)."""
    q = cfg.get("quantization_config")
    name = detected_format(q if isinstance(q, dict) else None, file_inside(root))
    if name is not None:
        return FORMATS[name]
    method = q.get("quant_method") if isinstance(q, dict) else None
    method = method.lower() if isinstance(method, str) else ""
    expected = "; ".join(f"{f.name}: {f.detection or f.quant_method!r}" for f in FORMATS.values())
    raise CheckpointError(f"{root}: not an NVFP4 checkpoint (config.json quantization_config.quant_method="
                          f"{method or None!r}; expected {expected})")


def checkpoint_format(path: Union[str, os.PathLike]) -> str:
    """The name of the checkpoint's format ("compressed-tensors", "modelopt", or another registered
    one), from config.json's ``quantization_config.quant_method`` (ModelOpt: else the presence of
    hf_quant_config.json)."""
    root = checkpoint_dir(path)
    return _format(root, read_json(inside(root, CONFIG_FILE, "model config"), CONFIG_FILE)).name


# ---- configs --------------------------------------------------------------------------------------
def _side_files(root: Path, fmt: CheckpointFormat) -> dict[str, dict]:
    """The format's side files that are present, each read as a checked JSON object."""
    out = {}
    for name, what in fmt.side_file_names.items():
        f = root / name
        if f.exists() or f.is_symlink():
            out[name] = read_json(inside(root, name, what), name)
    return out


def _quant_spec(root: Path, fmt: CheckpointFormat, cfg: dict) -> tuple[QuantScheme, dict]:
    """(the scheme from the format's parse_config, checked quantization_config.blockscale section)."""
    inline = cfg.get("quantization_config")
    try:
        spec = fmt.parse_config(inline, _side_files(root, fmt))
        return spec, schema.blockscale_section(inline)
    except schema.ConfigError as e:
        raise CheckpointError(f"{root / (e.file or CONFIG_FILE)}: {e}") from None


def _resolve_dtype(dtype, cfg: dict, bs: dict) -> tuple[torch.dtype, bool]:
    """(dtype of the non-quantized tensors, whether the caller chose it); default: the model dtype
    recorded in ``quantization_config.blockscale.dtype``, else config.json's ``dtype``."""
    if dtype is None:
        if bs.get("dtype"):
            return getattr(torch, bs["dtype"]), False
        return schema.model_dtype(cfg) or torch.float32, False
    d = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if d not in LOAD_DTYPES:
        raise UsageError(f"dtype={dtype!r}: expected torch.float32, torch.float16, torch.bfloat16 or torch.float64")
    return d, True


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UsageError(f"device={device!r}: not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device={device!r}: CUDA is not available on this machine")
    return dev


def _one_line(e: BaseException, limit: int = 500) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _transformers_config(cfg: dict, config_path: Path):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{config_path}: model_type={model_type!r} is not a model type transformers knows")
    try:
        return CONFIG_MAPPING[model_type].from_dict({k: v for k, v in cfg.items() if k != "quantization_config"})
    except Exception as e:  # noqa: BLE001 - transformers raises anything on hostile configs
        raise CheckpointError(f"{config_path}: transformers cannot read it ({_one_line(e)})") from None


# ---- the plan: what the checkpoint must hold, from a meta-device build -----------------------------
@dataclass(frozen=True)
class _QLinear:
    in_features: int
    out_features: int
    bias: bool
    rule: Optional[str]
    error: str


@dataclass
class _Plan:
    quantized: dict  # module name -> _QLinear
    expected_q: dict  # tensor name -> (module, on-disk suffix, dtype, allowed shapes)
    plain: dict  # tensor name -> (dtype, shape)
    model_bytes: int


def _build(config, dtype: torch.dtype, config_path: Path, meta: bool):
    from transformers import AutoModelForCausalLM

    try:
        if meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, dtype=dtype)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{config_path}: transformers cannot build the model it describes "
                              f"({_one_line(e)})") from None


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


def _plan(model: nn.Module, spec: QuantScheme, bs: dict, fmt: CheckpointFormat, config_path: Path) -> _Plan:
    w4a4 = spec.w4a4
    quantized: dict[str, _QLinear] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not spec.quantizes(name):
            continue
        if m.in_features % 16:
            raise CheckpointError(f"{config_path}: {name}: in_features={m.in_features} is not a multiple of 16, so it "
                                  "cannot be NVFP4; the quantization config should list it in ignore / exclude_modules")
        rule, err = None, "mse"
        if w4a4:
            o = bs["input_overrides"].get(name, {})
            rule = o.get("input_scale_rule") or bs["input_scale_rule"] or "6"
            err = o.get("input_error") or bs["input_error"] or "mse"
        quantized[name] = _QLinear(m.in_features, m.out_features, m.bias is not None, rule, err)
    expected_q = {}
    for name, q in quantized.items():
        for suffix, (dt, shapes) in fmt.expected_tensors(q.in_features, q.out_features, w4a4).items():
            expected_q[f"{name}.{suffix}"] = (name, suffix, dt, shapes)
    plain = {k: (t.dtype, tuple(t.shape)) for k, t in _unshared(model).items()
             if not (k.rpartition(".")[0] in quantized and k.rpartition(".")[2] != "bias")}
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return _Plan(quantized, expected_q, plain, sum(seen.values()))


def _list(names, k=8) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _check_plan(plan: _Plan, shards: Shards, root: Path, fmt_name: str, w4a4: bool, explicit: bool) -> None:
    """Names, dtypes and shapes of every expected tensor against the headers."""
    present, expected = set(shards.infos), set(plan.expected_q) | set(plan.plain)
    missing, unexpected = expected - present, present - expected
    if missing or unexpected:
        msg = [f"{root}: the tensors do not match the config ({fmt_name}, {'W4A4' if w4a4 else 'W4A16'}, "
               f"{len(plan.quantized)} NVFP4 Linears)"]
        if missing:
            msg.append(f"missing: {_list(missing)}")
        if unexpected:
            msg.append(f"unexpected: {_list(unexpected)}")
        raise CheckpointError("; ".join(msg))
    for key in sorted(expected):
        t, f = shards.infos[key], shards.path(key)
        if key in plan.expected_q:
            _, _, dt, shapes = plan.expected_q[key]
            if t.dtype != dt or t.shape not in {tuple(s) for s in shapes}:
                want = " or ".join(str(list(s)) for s in shapes)
                raise CheckpointError(f"{f}: tensor {key!r}: {t.dtype} {list(t.shape)}, expected {dt} {want}")
            continue
        dt, shape = plan.plain[key]
        if t.shape != shape:
            raise CheckpointError(f"{f}: tensor {key!r}: shape {list(t.shape)}, the config implies {list(shape)}")
        if t.dtype != dt and not (explicit and t.dtype.is_floating_point and dt.is_floating_point):
            raise CheckpointError(f"{f}: tensor {key!r}: {t.dtype}, expected {dt} (the model dtype; pass dtype= to "
                                  "cast)")


def _check_values(plan: _Plan, shards: Shards, fmt: CheckpointFormat, root: Path) -> None:
    scale, outer = fmt.suffix("weight_scale"), (fmt.suffix("weight_global_scale"), fmt.suffix("input_global_scale"))
    for key, (_, suffix, _, _) in plan.expected_q.items():
        if suffix == scale:
            check_block_scales(key, shards.view(key), shards.path(key))
        elif suffix in outer:
            check_outer_scale(key, shards.view(key), shards.path(key))
    for name in plan.quantized:
        key = f"{name}.{outer[0]}"
        stored = shards.view(key)
        check_decode_range(key, stored, fmt.decode_scale(stored), shards.view(f"{name}.{scale}"), shards.path(key))
    for key in plan.plain:
        check_finite(key, shards.view(key), shards.path(key))
    stored = {n: {s: shards.view(f"{n}.{s}") for s in outer if f"{n}.{s}" in plan.expected_q} for n in plan.quantized}
    groups = sibling_groups(list(plan.quantized))
    try:
        for s in outer:
            check_shared_scales({n: d.get(s) for n, d in stored.items()}, s, groups)
    except ValueError as e:
        raise CheckpointError(f"{root}: {e}") from None


# ---- filling the model ----------------------------------------------------------------------------
def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _fill(model: nn.Module, plan: _Plan, shards: Shards, fmt: CheckpointFormat, dtype: torch.dtype) -> None:
    quantized: dict[str, NVFP4Linear] = {}
    for name, q in plan.quantized.items():
        w = model.get_submodule(name).weight
        new = NVFP4Linear(q.in_features, q.out_features, q.bias, input_scale_rule=q.rule, input_error=q.error,
                          dtype=w.dtype if w.is_floating_point() else dtype)
        _replace(model, name, new)
        quantized[name] = new
    state = drop_shared(model, model.state_dict())
    plain = {k: v for k, v in state.items()
             if not (k.rpartition(".")[0] in quantized and k.rpartition(".")[2] != "bias")}
    if set(plain) != set(plan.plain):  # pragma: no cover - the meta build and the real one differ
        raise CheckpointError(f"{shards.root}: the model transformers built differs from its meta-device build "
                              f"({_list(set(plain) ^ set(plan.plain))})")
    with torch.no_grad():
        for name, m in quantized.items():
            t = {s: shards.get(key) for key, (n, s, _, _) in plan.expected_q.items() if n == name}
            try:
                layer = fmt.read_layer(t)
            except ValueError as e:
                raise CheckpointError(f"{shards.root}: {name}: {e}") from None
            m.weight_packed.copy_(layer.weight_packed)
            m.weight_scale.copy_(layer.weight_scale)
            m.weight_global_scale.copy_(layer.weight_global_scale)
            if layer.input_global_scale is not None:
                m.input_global_scale.copy_(layer.input_global_scale)
        for key, target in plain.items():
            target.copy_(shards.view(key).to(target.dtype))


def load_checkpoint(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None, device="cpu",
                    verify: bool = True):
    """Load a checkpoint written by ``export_checkpoint`` (either format) as a transformers causal LM
    with ``NVFP4Linear`` modules, in eval mode.

    dtype: of the non-quantized weights and activations (default: ``quantization_config.blockscale.dtype``,
      the exported model's dtype, else config.json's ``dtype``); floating
      tensors stored in another dtype are cast only when ``dtype`` is given explicitly.
    verify: check the SHA-256 digests of every tensor and of config.json that our exports record
      (checkpoints of other producers have none and load without); ``False`` skips only that check.
    Everything is validated before the model is allocated (see the module docstring): strict names /
    dtypes / shapes, finite non-negative block scales, positive normal finite outer scales, finite
    weights, fused siblings sharing their outer scales; W4A4 activation rules come from
    ``quantization_config.blockscale`` (default "6"). Raises ``CheckpointError`` (a ValueError) naming
    the file and the tensor or key; ``UsageError`` for a bad ``dtype`` / ``device``.
    """
    dev = _device(device)
    root = checkpoint_dir(path)
    config_path = inside(root, CONFIG_FILE, "model config")
    cfg = read_json(config_path, CONFIG_FILE)
    fmt = _format(root, cfg)
    spec, bs = _quant_spec(root, fmt, cfg)
    try:
        schema.check_model_config(cfg)
    except schema.ConfigError as e:
        raise CheckpointError(f"{config_path}: {e}") from None
    dtype, explicit = _resolve_dtype(dtype, cfg, bs)

    shards = Shards(root)
    try:
        check_sizes(cfg, shards, config_path)
        config = _transformers_config(cfg, config_path)
        plan = _plan(_build(config, dtype, config_path, meta=True), spec, bs, fmt, config_path)
        _check_plan(plan, shards, root, fmt.name, spec.w4a4, explicit)
        check_model_bytes(plan.model_bytes, shards, config_path)
        _check_values(plan, shards, fmt, root)
        if verify:
            verify_digests(shards, cfg, config_path, bs["tensor_digests"])
        model = _build(config, dtype, config_path, meta=False)
        _fill(model, plan, shards, fmt, dtype)
    finally:
        shards.close()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()
    return model.to(dev)


__all__ = ["checkpoint_format", "load_checkpoint"]
