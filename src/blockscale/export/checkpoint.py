"""export_checkpoint: write an NVFP4-quantized Hugging Face model as a checkpoint serving engines load."""
from __future__ import annotations

import copy
import datetime
import json
import math
from collections import Counter
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..nn.coverage import weight_coverage
from ..nn.nvfp4_linear import NVFP4Linear
from .common import CONFIG_FILE, PRODUCER, REPORT_FILE, blockscale_version, drop_shared, model_dtype
from .destination import atomic_directory, check_output, written_by_export
from .registry import CheckpointFormat, format_named
from .shared_scales import check_group_membership, check_shared_scales, sibling_groups
from .writer import parse_size, write_json, write_safetensors


def _json_safe(metadata: Optional[dict]) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serializable (str/int/float/bool/None/list/dict, finite "
                        f"numbers): {e}") from None


def _extra_files(extra) -> dict[str, object]:
    """``extra_files`` checked: plain ``*.json`` names we do not write ourselves -> JSON values."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra_files must be a dict of file name -> JSON value, got {type(extra).__name__}")
    out = {}
    for name, obj in extra.items():
        if not isinstance(name, str):
            raise TypeError(f"extra_files key {name!r}: expected a file name (str)")
        if Path(name).name != name or name.startswith(".") or "\\" in name or not name.strip():
            raise ValueError(f"extra_files key {name!r}: expected a plain file name (no directory, not hidden)")
        if not name.endswith(".json"):
            raise ValueError(f"extra_files key {name!r}: only .json files can be added")
        if written_by_export(name):
            raise ValueError(f"extra_files key {name!r} is a file written by the export itself; choose another name")
        try:
            out[name] = json.loads(json.dumps(obj, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra_files[{name!r}] must be JSON-serializable (str/int/float/bool/None/list/dict, "
                            f"finite numbers): {e}") from None
    return out


def _high_precision(model: nn.Module) -> tuple[list[str], dict, dict]:
    """(names for ``ignore`` / ``exclude_modules``, report entries, element counts) of the modules
    whose floating-point weight matrices (>= 2 dims) are not NVFP4 (``weight_coverage``): high-precision
    Linears, fused 3-D MoE experts, routers, embeddings (embeddings are not listed in ``ignore``).
    high_precision_fraction = H / (Q + H), Q = NVFP4 weight elements, H = high-precision ones, each
    stored tensor counted once (a tied lm_head adds nothing to H)."""
    cov = weight_coverage(model)
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    entries: dict[str, dict] = {}
    high = 0
    for name, n in cov.high_precision.items():
        m = modules[name]
        params = {k: p for k, p in m.named_parameters(recurse=False) if p.is_floating_point() and p.dim() >= 2}
        entry = {"type": type(m).__name__, "elements": n, "parameters": {k: list(p.shape) for k, p in params.items()}}
        tied = {owner.get(id(p)) for p in params.values()}
        if len(tied) == 1 and None not in tied:
            entry["tied_to"] = tied.pop()
        high += sum(p.numel() for p in params.values() if id(p) not in owner)
        for p in params.values():
            owner.setdefault(id(p), name)
        entries[name] = entry
    ignore = [n for n in entries if n and not isinstance(modules[n], nn.Embedding)]
    total = cov.quantized_elements + high
    counts = {"quantized": cov.quantized_elements, "high_precision": high,
              "high_precision_fraction": high / total if total else 0.0}
    return ignore, entries, counts


def _check_module(name: str, m: NVFP4Linear) -> None:
    N, K = m.out_features, m.in_features
    want = {"weight_packed": (torch.uint8, (N, K // 2)), "weight_scale": (torch.float8_e4m3fn, (N, K // 16)),
            "weight_global_scale": (torch.float32, (1,))}
    if m.input_global_scale is not None:
        want["input_global_scale"] = (torch.float32, (1,))
    for buf, (dt, shape) in want.items():
        t = getattr(m, buf)
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"{name}.{buf}: {t.dtype} {tuple(t.shape)}, expected {dt} {shape}")
    for buf in ("weight_global_scale", "input_global_scale"):
        t = getattr(m, buf)
        if t is not None and not (bool(torch.isfinite(t).all()) and float(t.reshape(-1)[0]) > 0):
            raise ValueError(f"{name}.{buf}={float(t.reshape(-1)[0])!r}: outer scales must be positive and finite")
    if m.bias is not None and tuple(m.bias.shape) != (N,):
        raise ValueError(f"{name}.bias: shape {tuple(m.bias.shape)}, expected ({N},)")


def _collect(model: nn.Module):
    quantized: dict[str, NVFP4Linear] = {}
    high: list[str] = []
    linears: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            quantized[name] = m
            linears.append(name)
        elif isinstance(m, nn.Linear):
            high.append(name)
            linears.append(name)
    return quantized, high, linears


def _activation_meta(quantized: dict[str, NVFP4Linear]) -> dict:
    rules = {n: m.input_scale_rule for n, m in quantized.items()}
    errors = {n: m.input_error for n, m in quantized.items()}
    rule = Counter(rules.values()).most_common(1)[0][0]
    err = Counter(errors.values()).most_common(1)[0][0]
    meta = {"input_scale_rule": rule, "input_error": err}
    over = {n: {"input_scale_rule": rules[n], "input_error": errors[n]}
            for n in quantized if rules[n] != rule or errors[n] != err}
    if over:
        meta["input_overrides"] = over
    return meta


def _tensors(model: nn.Module, quantized: dict[str, NVFP4Linear], fmt: CheckpointFormat) -> dict[str, torch.Tensor]:
    state = drop_shared(model, model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if mod in quantized and leaf in fmt.tensor_names:
            leaf, t = fmt.export_tensor(leaf, t)
            key = f"{mod}.{leaf}"
        if key in out:
            raise ValueError(f"two tensors would be written as {key!r}")
        out[key] = t.detach()
    return out


# config.json's dtype is the format's ``serving_dtype`` when it has one (compressed-tensors' runtime
# decompresses NVFP4 weights to bfloat16 whatever the model dtype, so transformers' default
# ``dtype="auto"`` must be bfloat16 for the first forward to run); our own loader reads
# ``blockscale.dtype`` instead.
USE_CACHE_ATTR = "blockscale_use_cache"  # the model's own use_cache, set by models.hf.load_model


def _config_json(model: nn.Module, dtype: torch.dtype, qcfg: dict) -> dict:
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = dtype
    own = getattr(model, USE_CACHE_ATTR, None)
    if isinstance(own, bool) and hasattr(cfg, "use_cache"):
        cfg.use_cache = own
    cfg.architectures = [type(model).__name__]
    d = json.loads(cfg.to_json_string(use_diff=True))
    d["quantization_config"] = qcfg
    return d


def export_checkpoint(model: nn.Module, out_dir: Union[str, Path], format: str = "compressed-tensors", *,
                      tokenizer=None, max_shard_size: Union[int, str] = "2GB", metadata: Optional[dict] = None,
                      overwrite: bool = False, source=None, extra_files: Optional[dict] = None) -> Path:
    """Write ``model`` (a transformers causal LM whose quantized Linears are ``NVFP4Linear``) to ``out_dir``.

    format: "compressed-tensors" (``nvfp4-pack-quantized``; vLLM / SGLang / TensorRT-LLM) or "modelopt"
      (ModelOpt unified HF checkpoint, ``modelopt_fp4``). Both store the same packed codes and E4M3 block
      scales; compressed-tensors stores the encode scale S, ModelOpt its reciprocal fl(1/S). Any format
      registered in ``export.registry`` (``export.FORMATS``, with its aliases) is accepted.
    Every module holding floating-point weight matrices (>= 2 dims) that are not NVFP4 (other
    ``nn.Linear``, fused 3-D MoE experts, routers) is written in high precision and listed in
    ``ignore`` / ``exclude_modules`` (embeddings are not listed: no engine quantizes them); the report
    lists all of them with element counts and ``quantization_config.blockscale.high_precision_fraction``
    = H / (Q + H) (Q NVFP4 weight elements, H high-precision ones, tied tensors counted once).
    Non-quantized tensors keep the model's dtype (recorded as ``quantization_config.blockscale.dtype``,
    which ``load_checkpoint`` uses by default); tied embeddings are written once. For compressed-tensors
    config.json's ``dtype`` is bfloat16, the dtype compressed-tensors' runtime decompresses to, so plain
    ``AutoModelForCausalLM.from_pretrained(dir)`` runs (in bf16); ModelOpt's keeps the model dtype.
    config.json's ``use_cache`` is the model's own (``models.hf.load_model`` turns it off for evaluation).
    Fused siblings (q/k/v, gate/up, w1/w3) must share one outer scale (ValueError otherwise).
    Files: safetensors (sharded above ``max_shard_size`` with ``model.safetensors.index.json``),
    config.json (+ ``quantization_config``), generation_config.json, tokenizer files (if ``tokenizer``),
    the format's side files (ModelOpt: hf_quant_config.json), ``extra_files``, blockscale_report.json; each with mode
    0o666 & ~umask. All are written into a temporary sibling ``.NAME.tmp-<host>-<pid>-<hex>`` renamed
    into place at the end (stale ones left by killed exports of NAME are deleted; see ``destination``).
    An existing non-empty ``out_dir`` is refused (FileExistsError) unless ``overwrite=True`` and it is a
    blockscale checkpoint (``is_blockscale_export``) holding nothing a blockscale export does not write.
    ``source``: the path (or list of paths) of the model being read; ``out_dir`` may not be, lie inside
      or contain it (UsageError, a ValueError), so an export never replaces its own source.
    ``metadata``: JSON-serializable calibration / method info stored under ``quantization_config.blockscale``.
    ``extra_files``: {plain file name ending in .json: JSON value} written with the others (run reports
      such as ptq_report.json), recorded in the report's ``written_files``.
    Returns the output directory.
    """
    fmt = format_named(format)
    fmt_name = fmt.name
    shard_bytes = parse_size(max_shard_size)
    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "to_json_string"):
        raise TypeError("model must be a transformers PreTrainedModel (an nn.Module with a .config)")
    user_meta = _json_safe(metadata)
    extras = _extra_files(extra_files)
    out_dir = check_output(out_dir, overwrite, source)

    quantized, high, linears = _collect(model)
    if not quantized:
        raise ValueError("the model has no NVFP4Linear modules: nothing to export as an NVFP4 checkpoint "
                         "(quantize it first, e.g. with blockscale.ptq.quantize_model)")
    ignore, high_modules, elements = _high_precision(model)
    for name, m in quantized.items():
        _check_module(name, m)
    w4a4_of = {n: m.input_global_scale is not None for n, m in quantized.items()}
    if len(set(w4a4_of.values())) > 1:
        a4 = [n for n, v in w4a4_of.items() if v][:3]
        a16 = [n for n, v in w4a4_of.items() if not v][:3]
        raise ValueError(f"mixed W4A4 ({a4}...) and W4A16 ({a16}...) NVFP4Linear modules: a checkpoint holds one "
                         "activation scheme for all quantized Linears")
    w4a4 = next(iter(w4a4_of.values()))
    check_group_membership(set(quantized), linears)
    groups = sibling_groups(list(quantized))
    check_shared_scales({n: m.weight_global_scale for n, m in quantized.items()},
                        "weight_global_scale (weight encode scale S)", groups)
    if w4a4:
        check_shared_scales({n: m.input_global_scale for n, m in quantized.items()},
                            "input_global_scale (activation encode scale)", groups,
                            " For activations: calibrate the group on its shared input (one amax).")
    for n, m in quantized.items():
        fmt.check_module(n, m)

    version = blockscale_version()
    dtype = model_dtype(model)
    producer = {"name": PRODUCER, "version": version}
    bs_meta = {"version": version, "format": fmt_name, "scheme": "NVFP4" if w4a4 else "NVFP4A16",
               "activations": "W4A4" if w4a4 else "W4A16", "tensor_digests": "sha256",
               "dtype": str(dtype).removeprefix("torch.")}
    if w4a4:
        bs_meta.update(_activation_meta(quantized))
    bs_meta["high_precision_fraction"] = elements["high_precision_fraction"]
    if "method" in user_meta:
        bs_meta["method"] = user_meta["method"]
    if user_meta:
        bs_meta["metadata"] = user_meta
    qcfg = fmt.quantization_config(w4a4, ignore, producer, bs_meta)
    config_json = _config_json(model, fmt.serving_dtype or dtype, qcfg)
    tensors = _tensors(model, quantized, fmt)

    with atomic_directory(out_dir, overwrite) as tmp:
        info = write_safetensors(tmp, tensors, shard_bytes, config=config_json)
        write_json(tmp / CONFIG_FILE, config_json)
        gen = getattr(model, "generation_config", None)
        if gen is not None and getattr(model, "can_generate", lambda: False)():
            gen.save_pretrained(str(tmp))
        for name, obj in fmt.side_files(w4a4, ignore, producer).items():
            write_json(tmp / name, obj)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        for name, obj in extras.items():
            if (tmp / name).exists():
                raise ValueError(f"extra_files key {name!r}: the export already wrote a file of that name")
            write_json(tmp / name, obj)
        report = {
            "producer": producer,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "format": fmt_name,
            "quantization": bs_meta,
            "model": {"architecture": type(model).__name__, "dtype": str(dtype).removeprefix("torch.")},
            "quantized_modules": {
                n: {"shape": [m.out_features, m.in_features], "bias": m.bias is not None,
                    "weight_global_scale": float(m.weight_global_scale.reshape(-1)[0]),
                    **({"input_global_scale": float(m.input_global_scale.reshape(-1)[0]),
                        "input_scale_rule": m.input_scale_rule, "input_error": m.input_error} if w4a4 else {})}
                for n, m in quantized.items()},
            "high_precision_linears": high,
            "high_precision_modules": high_modules,
            "weight_elements": elements,
            "fused_groups": groups,
            "files": info["files"],
            "tensors": len(tensors),
            "total_size": info["total_size"],
            "bits_per_quantized_weight": _bits(quantized),
            "written_files": sorted({*(f.name for f in tmp.iterdir() if f.is_file()), REPORT_FILE}),
        }
        write_json(tmp / REPORT_FILE, report)
    return out_dir


def _bits(quantized: dict[str, NVFP4Linear]) -> float:
    n = sum(m.out_features * m.in_features for m in quantized.values())
    b = sum(m.weight_packed.numel() + m.weight_scale.numel() + 4 for m in quantized.values()) * 8
    return round(b / n, 4) if n else math.nan


__all__ = ["export_checkpoint", "REPORT_FILE"]
