"""load_checkpoint / checkpoint_format: read a quantized checkpoint back into a transformers model whose
quantized Linears are ``NVFP4Linear`` / ``FP8Linear`` / ``MXLinear`` with the checkpoint's FP8
KV-cache scales (logits equal the exported model's bit for bit).

Which format a checkpoint is comes from the one detector (``models.checkpoint_detection``, fed by the
registered formats); everything format-specific is its ``CheckpointFormat``'s (config parsing, KV
naming: ``registry``) or its codecs' (each Linear's tensors: ``codecs``), so nothing here names a format. The plan and the checks: ``load_plan``.

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
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..errors import UsageError
from ..models.checkpoint_detection import detected_format, file_inside
from ..models.routing_config import check_model_config
from ..nn.input_rotation import attach_input_rotation
from ..nn.kv_cache import attach_key_rotation, set_kv_scales
from . import schema
from .common import FORMATS, CheckpointError, drop_shared
from .experts import split_experts
from .files import Shards, checkpoint_dir, inside, read_json
from .load_plan import Plan, build_plan, check_plan, check_values
from .codecs import codec_for
from .module_schemes import build_module, rules_of, scheme_of
from .registry import CheckpointFormat, ParsedConfig
from .validate import check_model_bytes, check_sizes, verify_digests

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


def _quant_spec(root: Path, fmt: CheckpointFormat, cfg: dict) -> tuple[ParsedConfig, dict]:
    """(the per-module schemes the format's configs give, checked quantization_config.blockscale section)."""
    inline = cfg.get("quantization_config")
    try:
        side = _side_files(root, fmt)
        parsed = fmt.parse(inline, side)
        return parsed, schema.blockscale_section(inline)
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
        config = CONFIG_MAPPING[model_type].from_dict({k: v for k, v in cfg.items() if k != "quantization_config"})
    except Exception as e:  # noqa: BLE001 - transformers raises anything on hostile configs
        raise CheckpointError(f"{config_path}: transformers cannot read it ({_one_line(e)})") from None
    check_model_config(config, config_path)
    return config


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


# ---- filling the model ----------------------------------------------------------------------------
def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _list(names, k=8) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _cat_rows(parts: list) -> nn.Module:
    """One quantized Linear whose rows are those of ``parts`` in order (an expert's gate then up Linear);
    per-tensor scales (NVFP4 outer and input scales, FP8 per-tensor scales) must be equal (checked before: ``load_plan._check_experts_shared``)."""
    first = parts[0]
    out = build_module(scheme_of(first), rules_of(first), first.in_features, sum(m.out_features for m in parts),
                       False, first._dtype)
    with torch.no_grad():
        for b, t in out.named_buffers(recurse=False):
            if t is None:
                continue
            src = [getattr(m, b) for m in parts]
            t.copy_(src[0] if t.shape == src[0].shape else torch.cat(src))
    return out


def _stack_experts(model: nn.Module, plan: Plan, linears: dict) -> None:
    """Each fused-experts module of the plan becomes the ``QuantizedExperts`` of its filled per-expert Linears
    (on-disk name -> module; gate and up rows concatenated)."""
    from ..nn.quantized_experts import QuantizedExperts

    for name, qe in plan.experts.items():
        per = {(e, p): linears[n] for e, p, n in qe.linears}
        gate_up = [per[(e, "gate_up")] if (e, "gate_up") in per else _cat_rows([per[(e, "gate")], per[(e, "up")]])
                   for e in range(qe.experts)]
        down = [per[(e, "down")] for e in range(qe.experts)]
        try:
            new = QuantizedExperts.from_linears(model.get_submodule(name), gate_up, down)
        except ValueError as err:
            raise CheckpointError(f"{plan.disk(name)}: {err}") from None
        _replace(model, name, new)


def _fill(model: nn.Module, plan: Plan, shards: Shards, fmt: CheckpointFormat, dtype: torch.dtype) -> None:
    expert_linears = {n for qe in plan.experts.values() for _, _, n in qe.linears}
    quantized: dict[str, nn.Module] = {}
    detached: dict[str, nn.Module] = {}  # the experts' per-expert Linears (not modules of the model)
    for name, q in plan.quantized.items():
        if name in expert_linears:
            detached[name] = build_module(q.scheme, q.rules, q.in_features, q.out_features, False, dtype)
            continue
        w = model.get_submodule(plan.memory(name)).weight
        new = build_module(q.scheme, q.rules, q.in_features, q.out_features, q.bias,
                           w.dtype if w.is_floating_point() else dtype)
        _replace(model, plan.memory(name), new)
        quantized[name] = new
    state = drop_shared(model, model.state_dict())
    q_mem = {plan.memory(n) for n in quantized}
    plain = {}
    for k, v in state.items():
        mod, _, leaf = k.rpartition(".")
        if (mod in q_mem and leaf != "bias") or (mod in plan.experts and leaf not in plan.experts[mod].kept):
            continue
        if mod in plan.high_experts:  # stored per expert: filled through views of gate_up_proj / down_proj
            if leaf == "gate_up_proj":
                plain.update(split_experts(plan.disk(mod), v, state[f"{mod}.down_proj"], plan.family))
            continue
        plain[plan.disk(k)] = v
    if set(plain) != set(plan.plain):  # pragma: no cover - the meta build and the real one differ
        raise CheckpointError(f"{shards.root}: the model transformers built differs from its meta-device build "
                              f"({_list(set(plain) ^ set(plan.plain))})")
    with torch.no_grad():
        for name, m in {**quantized, **detached}.items():
            s = plan.quantized[name].scheme
            t = {suf: shards.get(key) for key, (n, suf, _, _) in plan.expected_q.items() if n == name}
            try:
                bufs = codec_for(fmt, s, name).read(s, t)
            except ValueError as e:
                raise CheckpointError(f"{shards.root}: {name}: {e}") from None
            for buf, v in bufs.items():
                getattr(m, buf).copy_(v.reshape(getattr(m, buf).shape))
        for key, target in plain.items():
            target.copy_(shards.view(key).to(target.dtype))
        kv: dict[str, dict] = {}
        for key, (attn, which, _) in plan.kv.items():
            kv.setdefault(attn, {})[which] = shards.get(key).to(torch.float32).reshape(-1)
    for attn, d in kv.items():
        set_kv_scales(model.get_submodule(attn), d["k_scale"], d["v_scale"],
                      "nvfp4" if plan.kv_granularity == "nvfp4" else "fp8-e4m3")
    for name, (group, _, _) in plan.rotations.items():  # online rotations (compressed-tensors transform_config)
        attach = attach_key_rotation if group.location == "attention" else attach_input_rotation
        attach(model.get_submodule(plan.memory(name)), plan.rotation_of(shards, name), group.name)
    _stack_experts(model, plan, detached)


def load_checkpoint(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None, device="cpu",
                    verify: bool = True):
    """Load a checkpoint written by ``export_checkpoint`` (either format) as a transformers causal LM
    with ``NVFP4Linear`` / ``FP8Linear`` / ``MXLinear`` modules (each Linear the scheme its config
    group / ``quantized_layers`` entry gives) and FP8 KV-cache scales (``nn.set_kv_scales``), in eval mode.

    dtype: of the non-quantized weights and activations (default: ``quantization_config.blockscale.dtype``,
      the exported model's dtype, else config.json's ``dtype``); floating
      tensors stored in another dtype are cast only when ``dtype`` is given explicitly.
    verify: check the SHA-256 digests of every tensor and of config.json that our exports record
      (checkpoints of other producers have none and load without); ``False`` skips only that check.
    Everything is validated before the model is allocated (see the module docstring): strict names /
    dtypes / shapes, finite non-negative block scales, positive normal finite outer scales, finite
    weights, fused siblings sharing their outer scales, FP8 codes without NaN bytes, FP8 and KV scales
    finite and > 0, UE8M0 bytes != 255; W4A4 activation rules and MX scale rules come from
    ``quantization_config.blockscale`` (defaults "6" and "ceil"). Raises ``CheckpointError`` (a
    ValueError) naming the file and the tensor or key; ``UsageError`` for a bad ``dtype`` / ``device``.
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
        plan = build_plan(_build(config, dtype, config_path, meta=True), spec, bs, fmt, config_path, cfg,
                          set(shards.infos))
        check_plan(plan, shards, root, fmt.name, explicit)
        check_model_bytes(plan.model_bytes, shards, config_path)
        check_values(plan, shards, fmt, root)
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
