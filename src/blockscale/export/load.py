"""load_checkpoint / checkpoint_format: read an NVFP4 checkpoint back into a transformers model whose
quantized Linears are ``NVFP4Linear`` (logits equal the exported model's bit for bit)."""
from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..nn.nvfp4_linear import INPUT_SCALE_RULES, NVFP4Linear
from . import compressed_tensors, modelopt
from .common import FORMATS, CheckpointError, drop_shared
from .fused import check_shared_scales, sibling_groups
from .writer import INDEX_FILE, SINGLE_FILE

CONFIG_FILE = "config.json"
_MAX_HEADER = 100 * 1024 * 1024


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object")
    return obj


def _dir(path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    return p


def checkpoint_format(path: Union[str, os.PathLike]) -> str:
    """"compressed-tensors" or "modelopt", from config.json's ``quantization_config.quant_method``
    (else the presence of hf_quant_config.json)."""
    p = _dir(path)
    cfg = _read_json(p / CONFIG_FILE, CONFIG_FILE)
    q = cfg.get("quantization_config")
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if method == compressed_tensors.QUANT_METHOD:
        return compressed_tensors.NAME
    if method.startswith("modelopt"):
        return modelopt.NAME
    if not method and (p / modelopt.HF_QUANT_CONFIG).is_file():
        return modelopt.NAME
    raise CheckpointError(f"{p}: not an NVFP4 checkpoint (config.json quantization_config.quant_method="
                          f"{method or None!r}; expected 'compressed-tensors' or 'modelopt', or an hf_quant_config.json)")


# ---- safetensors files ----------------------------------------------------------------------------
def _validate_safetensors(f: Path) -> list[str]:
    """Check the header and that the data section matches the file size (a truncated file would
    otherwise fault inside the memory map); return the tensor names."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{f}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{f}: corrupt or truncated safetensors file (header length {n} > file size "
                                      f"{size})")
            header = json.loads(fh.read(n).decode("utf-8"))
    except CheckpointError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: corrupt safetensors header (not a JSON object)")
    end = 0
    names = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            a, b = v["data_offsets"]
            end = max(end, int(b))
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{f}: corrupt safetensors header entry for {k!r}") from None
        names.append(k)
    if 8 + n + end != size:
        raise CheckpointError(f"{f}: truncated or corrupt safetensors file: the header describes {8 + n + end} "
                              f"bytes, the file has {size}")
    return names


class _Shards:
    """Open safetensors shards of one checkpoint (weight_map-checked)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        index = root / INDEX_FILE
        if index.is_file():
            idx = _read_json(index, INDEX_FILE)
            wm = idx.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{index}: no weight_map")
            files = sorted(set(wm.values()))
        elif (root / SINGLE_FILE).is_file():
            wm, files = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._stack = contextlib.ExitStack()
        self.where: dict[str, str] = {}
        self.handles = {}
        for fname in files:
            f = root / fname
            if Path(fname).name != fname or not f.is_file():
                raise CheckpointError(f"{root}: shard {fname!r} listed in {INDEX_FILE} is missing")
            names = _validate_safetensors(f)
            try:
                h = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:
                self._stack.close()
                raise CheckpointError(f"{f}: cannot open safetensors file ({type(e).__name__}: {e})") from None
            self.handles[fname] = h
            for k in names:
                if k in self.where:
                    raise CheckpointError(f"tensor {k!r} is stored twice ({self.where[k]} and {fname})")
                self.where[k] = fname
        if wm is not None:
            bad = sorted(k for k, v in wm.items() if self.where.get(k) != v)
            extra = sorted(set(self.where) - set(wm))
            if bad or extra:
                raise CheckpointError(f"{index}: weight_map disagrees with the shards (listed elsewhere or missing: "
                                      f"{bad[:5]}, not listed: {extra[:5]})")

    def get(self, name: str) -> torch.Tensor:
        fname = self.where[name]
        try:
            return self.handles[fname].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{fname}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None

    def close(self):
        self._stack.close()


# ---- model ----------------------------------------------------------------------------------------
def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: expected a floating torch.dtype (e.g. torch.bfloat16)")
    return dtype


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shapes) -> None:
    if t.dtype != dtype or tuple(t.shape) not in {tuple(s) for s in shapes}:
        want = " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(f"tensor {name!r}: {t.dtype} {list(t.shape)}, expected {dtype} {want}")


def _list(names, k=8) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def load_checkpoint(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None, device="cpu"):
    """Load a checkpoint written by ``export_checkpoint`` (either format) as a transformers causal LM
    with ``NVFP4Linear`` modules, in eval mode.

    dtype: of the non-quantized weights and activations (default: config.json's ``dtype``); floating
      tensors stored in another dtype are cast only when ``dtype`` is given explicitly.
    Every tensor is checked against the config (names, dtypes, shapes; strict: missing or unexpected
    tensors are errors), fused siblings must share their outer scales, and W4A4 activation rules come
    from ``quantization_config.blockscale`` (default "6"). Raises ``CheckpointError`` (a ValueError).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    root = _dir(path)
    fmt_name = checkpoint_format(root)
    fmt = FORMATS[fmt_name]
    raw = _read_json(root / CONFIG_FILE, CONFIG_FILE)
    inline = raw.get("quantization_config")
    inline = inline if isinstance(inline, dict) else None
    try:
        if fmt_name == compressed_tensors.NAME:
            spec = compressed_tensors.parse_config(inline)
        else:
            hfq = root / modelopt.HF_QUANT_CONFIG
            spec = modelopt.parse_config(_read_json(hfq, modelopt.HF_QUANT_CONFIG) if hfq.is_file() else None, inline)
    except ValueError as e:
        raise CheckpointError(f"{root}: {e}") from None
    bs = (inline or {}).get("blockscale") or {}
    w4a4 = spec["w4a4"]

    try:
        config = AutoConfig.from_pretrained(str(root), trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(f"{root / CONFIG_FILE}: transformers cannot read it ({type(e).__name__}: {e})") from None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    explicit = dtype is not None
    dtype = _resolve_dtype(dtype, config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    # quantized modules: targeted nn.Linear not ignored
    rule_default = bs.get("input_scale_rule") or "6"
    err_default = bs.get("input_error") or "mse"
    overrides = bs.get("input_overrides") or {}
    quantized: dict[str, NVFP4Linear] = {}
    for name, m in list(model.named_modules()):
        if not isinstance(m, nn.Linear) or spec["is_ignored"](name) or not spec["is_target"](name):
            continue
        if m.in_features % 16:
            raise CheckpointError(f"{name}: in_features={m.in_features} is not a multiple of 16, so it cannot be "
                                  "NVFP4; the checkpoint config should list it in ignore/exclude_modules")
        rule = err = None
        if w4a4:
            o = overrides.get(name, {})
            rule, err = o.get("input_scale_rule", rule_default), o.get("input_error", err_default)
            if rule not in INPUT_SCALE_RULES:
                raise CheckpointError(f"{name}: input_scale_rule={rule!r} in quantization_config.blockscale; allowed "
                                      f"{INPUT_SCALE_RULES}")
        new = NVFP4Linear(m.in_features, m.out_features, m.bias is not None, input_scale_rule=rule,
                          input_error=err or "mse", dtype=m.weight.dtype if m.weight.is_floating_point() else dtype)
        _replace(model, name, new)
        quantized[name] = new

    # expected on-disk tensors
    expected_q: dict[str, tuple[str, str, torch.dtype, tuple]] = {}
    for name, m in quantized.items():
        for suffix, (dt, shapes) in fmt.expected_tensors(m.in_features, m.out_features, w4a4).items():
            expected_q[f"{name}.{suffix}"] = (name, suffix, dt, shapes)
    state = drop_shared(model, model.state_dict())
    plain = {k: v for k, v in state.items()
             if not (k.rpartition(".")[0] in quantized and k.rpartition(".")[2] != "bias")}

    shards = _Shards(root)
    try:
        present = set(shards.where)
        expected = set(expected_q) | set(plain)
        missing, unexpected = expected - present, present - expected
        if missing or unexpected:
            msg = [f"{root}: the tensors do not match the config ({fmt_name}, "
                   f"{'W4A4' if w4a4 else 'W4A16'}, {len(quantized)} NVFP4 Linears)"]
            if missing:
                msg.append(f"missing: {_list(missing)}")
            if unexpected:
                msg.append(f"unexpected: {_list(unexpected)}")
            raise CheckpointError("; ".join(msg))

        per_module: dict[str, dict[str, torch.Tensor]] = {n: {} for n in quantized}
        for key, (name, suffix, dt, shapes) in expected_q.items():
            t = shards.get(key)
            _check(key, t, dt, shapes)
            per_module[name][suffix] = t
        groups = sibling_groups(list(quantized))
        stored = {n: fmt.global_scale_tensors(t) for n, t in per_module.items()}
        try:
            for key in sorted({k for d in stored.values() for k in d}):
                check_shared_scales({n: d.get(key) for n, d in stored.items()}, key, groups)
        except ValueError as e:
            raise CheckpointError(f"{root}: {e}") from None
        with torch.no_grad():
            for name, t in per_module.items():
                m = quantized[name]
                try:
                    S, S_in = fmt.encode_scales(t)
                except ValueError as e:
                    raise CheckpointError(f"{name}: {e}") from None
                for what, s in (("weight", S), ("input", S_in)):
                    if s is not None and not (bool(torch.isfinite(s).all()) and float(s) > 0):
                        raise CheckpointError(f"{name}: {what} encode scale {float(s)!r} is not positive and finite")
                packed, scales = fmt.weight_tensors(t)
                m.weight_packed.copy_(packed)
                m.weight_scale.copy_(scales)
                m.weight_global_scale.copy_(S)
                if S_in is not None:
                    m.input_global_scale.copy_(S_in)

            for key, target in plain.items():
                t = shards.get(key)
                if tuple(t.shape) != tuple(target.shape):
                    raise CheckpointError(f"tensor {key!r}: shape {list(t.shape)}, the config implies "
                                          f"{list(target.shape)}")
                if t.dtype != target.dtype:
                    if not (explicit and t.is_floating_point() and target.is_floating_point()):
                        raise CheckpointError(f"tensor {key!r}: {t.dtype}, expected {target.dtype} (the model dtype; "
                                              "pass dtype= to cast)")
                    t = t.to(target.dtype)
                target.copy_(t)
    finally:
        shards.close()

    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()
    return model.to(device)


__all__ = ["checkpoint_format", "load_checkpoint"]
