"""export_checkpoint: write a quantized Hugging Face model (NVFP4 / FP8 / MX Linears, FP8 KV-cache
scales) as a checkpoint serving engines load."""
from __future__ import annotations

import copy
import datetime
import json
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..nn.coverage import weight_coverage
from ..nn.input_rotation import input_rotations
from ..nn.kv_cache import key_rotations
from . import export_plan
from .experts import ExpertsView, experts_view
from .common import CONFIG_FILE, PRODUCER, REPORT_FILE, blockscale_version, drop_shared, model_dtype
from .destination import atomic_directory, check_output, written_by_export
from .module_checks import kv_modules
from .module_schemes import quantized_modules, scheme_of
from .registry import format_named
from .shared_scales import sibling_groups
from ..file_errors import writing
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


def _high_precision(model: nn.Module, view: Optional[ExpertsView] = None) -> tuple[list[str], dict, dict]:
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
    if view is not None:  # hub names (Mixtral: ...block_sparse_moe.gate); excluded experts: + their Linears
        ignore = [h for n in ignore for h in (view.ignore_names(n) if n in view.high else [view.hub(n)])]
        entries = {view.hub(n): e for n, e in entries.items()}
    total = cov.quantized_elements + high
    counts = {"quantized": cov.quantized_elements, "high_precision": high,
              "high_precision_fraction": high / total if total else 0.0}
    return ignore, entries, counts


def _collect(model: nn.Module, view: Optional[ExpertsView] = None):
    """(quantized Linears: NVFP4Linear / FP8Linear / MXLinear, high-precision Linear names, all Linear names);
    with ``view`` (the model has NVFP4Experts): names in hub form, the per-expert NVFP4 Linears included."""
    quantized = quantized_modules(model)
    high: list[str] = []
    linears: list[str] = []
    for name, m in model.named_modules():
        if name in quantized:
            linears.append(name)
        elif isinstance(m, nn.Linear):
            high.append(name)
            linears.append(name)
    if view is None:
        return quantized, high, linears
    quantized = {view.hub(n): m for n, m in quantized.items()}
    quantized.update(view.linears)
    high_experts = [lin for n in view.high for lin in view.high_linears(n)]
    return (quantized, [view.hub(n) for n in high] + high_experts,
            [view.hub(n) for n in linears] + list(view.linears) + high_experts)


def export_state(model: nn.Module, view: Optional[ExpertsView]) -> dict[str, torch.Tensor]:
    """The model's state dict to write (tied copies dropped); with ``view``: in hub names, NVFP4Experts
    buffers replaced by the per-expert Linears' ones."""
    state = drop_shared(model, model.state_dict())
    return state if view is None else view.state(state)


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
                      overwrite: bool = False, source=None, extra_files: Optional[dict] = None,
                      tensor_source=None) -> Path:
    """Write ``model`` (a transformers causal LM whose quantized Linears are ``NVFP4Linear``, ``FP8Linear``
    or ``MXLinear``, optionally with FP8 KV-cache scales ``attn.k_scale`` / ``attn.v_scale``) to ``out_dir``.

    One path for every model (``export_plan``): each quantized Linear is written by the codec of the
    format that stores its scheme (``codecs``), the config by the format from the schemes. An all-NVFP4
    model without KV scales is the one-scheme case (one config group targeting ``Linear``; ModelOpt
    ``NVFP4`` / ``W4A16_NVFP4``). Several schemes: compressed-tensors one config group per scheme
    (targets: exact module names; ``format: "mixed-precision"`` when their formats differ), ModelOpt
    ``MIXED_PRECISION`` + ``quantized_layers``; FP8 KV-cache scales: ``kv_cache_scheme`` and
    ``<attn>.k_scale`` / ``<attn>.v_scale`` (compressed-tensors), ``kv_cache_quant_algo: "FP8"`` and
    ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` (ModelOpt); a scheme the format has no codec
    for (ModelOpt: fp8-block, MXFP4, ...) is a ValueError naming the module. NVFP4 W4A4 and W4A16
    Linears in one model are two schemes. ``quantization_config.blockscale`` records what the configs
    cannot say (NVFP4 activation rules, MX activation scale rules, the KV-cache granularity).

    format: "compressed-tensors" (``nvfp4-pack-quantized``; vLLM / SGLang / TensorRT-LLM) or "modelopt"
      (ModelOpt unified HF checkpoint, ``modelopt_fp4``). Both store the same packed codes and E4M3 block
      scales; compressed-tensors stores the encode scale S, ModelOpt its reciprocal fl(1/S). Any format
      registered in ``export.registry`` (``export.FORMATS``, with its aliases) is accepted.
    Every module holding floating-point weight matrices (>= 2 dims) that are not quantized (other
    ``nn.Linear``, fused 3-D MoE experts, routers) is written in high precision and listed in
    ``ignore`` / ``exclude_modules`` (embeddings are not listed: no engine quantizes them); the report
    lists all of them with element counts and ``quantization_config.blockscale.high_precision_fraction``
    = H / (Q + H) (Q NVFP4 weight elements, H high-precision ones, tied tensors counted once).
    Quantized fused MoE experts (``NVFP4Experts``; Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3) are
    written as per-expert NVFP4 Linears under the family's hub names (``export.experts``: what
    ``save_pretrained`` writes, e.g. ``...block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``, every other key
    renamed the same way), gate and up of one expert with the expert's one outer (and input) scale; fused
    experts kept in high precision in those families are written per expert the same way (``.weight``), the
    module and its per-expert Linears listed in ``ignore`` / ``exclude_modules``.
    Non-quantized tensors keep the model's dtype (recorded as ``quantization_config.blockscale.dtype``,
    which ``load_checkpoint`` uses by default); tied embeddings are written once. For compressed-tensors
    config.json's ``dtype`` is bfloat16, the dtype compressed-tensors' runtime decompresses to, so plain
    ``AutoModelForCausalLM.from_pretrained(dir)`` runs (in bf16); ModelOpt's keeps the model dtype.
    config.json's ``use_cache`` is the model's own (``models.hf.load_model`` turns it off for evaluation).
    Fused siblings (q/k/v, gate/up, w1/w3) must have one scheme and share one outer scale (NVFP4),
    per-tensor weight scale and static input scale (FP8) (ValueError otherwise).
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
    ``tensor_source(name, placeholder)``: the tensor to write for a meta-device tensor of ``model``
      (streaming PTQ: a skeleton whose decoder layers' large tensors are on the meta device, their exported
      tensors read back from part files; ``layer_tensors``); None: every tensor is real.
    Returns the output directory.
    """
    fmt = format_named(format)
    shard_bytes = parse_size(max_shard_size)
    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "to_json_string"):
        raise TypeError("model must be a transformers PreTrainedModel (an nn.Module with a .config)")
    user_meta = _json_safe(metadata)
    extras = _extra_files(extra_files)
    out_dir = check_output(out_dir, overwrite, source)

    view = experts_view(model)  # NVFP4Experts: per-expert Linears under the family's hub names
    quantized, high, linears = _collect(model, view)
    if not quantized:
        raise ValueError("the model has no NVFP4Linear / FP8Linear / MXLinear modules: nothing to export as a "
                         "quantized checkpoint (quantize it first, e.g. with blockscale.ptq.quantize_model)")
    ignore, high_modules, elements = _high_precision(model, view)
    schemes = {n: scheme_of(m) for n, m in quantized.items()}
    plan = export_plan.plan(model, fmt, quantized, schemes, kv_modules(model), linears)

    version = blockscale_version()
    dtype = model_dtype(model)
    producer = {"name": PRODUCER, "version": version}
    bs_meta = {"version": version, "format": fmt.name, **export_plan.blockscale_meta(plan, quantized),
               "tensor_digests": "sha256", "dtype": str(dtype).removeprefix("torch."),
               "high_precision_fraction": elements["high_precision_fraction"]}
    if "method" in user_meta:
        bs_meta["method"] = user_meta["method"]
    if user_meta:
        bs_meta["metadata"] = user_meta
    rotations, keys = input_rotations(model), key_rotations(model)
    if (rotations or keys) and fmt.transforms is None:
        first, what = (next(iter(rotations)), "an online input rotation") if rotations else \
            (next(iter(keys)), "a key rotation (R3)")
        table = rotations or keys
        raise ValueError(f"{fmt.name} checkpoints cannot hold online rotations ({first} has {what}, transform group "
                         f"{table[first][0]!r}; {len(rotations) + len(keys)} module(s) in all): export "
                         "compressed-tensors (transform_config), or rotate with fused rotations only (r1r2)")
    if rotations or keys:
        bs_meta["online_rotations"] = sorted({g for g, _ in list(rotations.values()) + list(keys.values())})
        biased = [n for n in rotations if getattr(model.get_submodule(n), "bias", None) is not None]
        if biased:
            warnings.warn(f"{len(biased)} Linear(s) with a bias have an online input rotation ({biased[0]}, ...): "
                          "blockscale.load and compressed-tensors apply it, but vLLM's transform loader refuses online "
                          "transforms on biased Linears", UserWarning, stacklevel=2)
    qcfg = fmt.quantization_config(schemes, ignore, producer, bs_meta, plan.kv_granularity)
    side = fmt.side_files(schemes, ignore, producer, plan.kv_granularity)
    tensors = export_plan.tensors(plan, quantized, fmt, export_state(model, view))
    if rotations or keys:
        entries, matrices = fmt.transforms(rotations, dtype, keys)
        qcfg.update(entries)
        tensors.update(matrices)
    config_json = _config_json(model, fmt.serving_dtype or dtype, qcfg)
    report = {
        "producer": producer,
        "format": fmt.name,
        "quantization": bs_meta,
        "model": {"architecture": type(model).__name__, "dtype": str(dtype).removeprefix("torch.")},
        "quantized_modules": {n: export_plan.report_entry(plan, n, m) for n, m in quantized.items()},
        "high_precision_linears": high,
        "high_precision_modules": high_modules,
        "weight_elements": elements,
        "fused_groups": sibling_groups(list(quantized)),
        **({"kv_cache_scales": export_plan.kv_report(plan)} if plan.kv else {}),
        **({"fused_experts": view.report()} if view is not None else {}),
        **({"online_rotations": {n: [g, r.describe()] for n, (g, r) in rotations.items()}} if rotations else {}),
        "tensors": len(tensors),
        "bits_per_quantized_weight": export_plan.bits_per_weight(quantized),
    }
    with atomic_directory(out_dir, overwrite) as tmp:
        info = write_safetensors(tmp, tensors, shard_bytes, config=config_json, materialize=tensor_source)
        _write_files(tmp, model, tokenizer, {CONFIG_FILE: config_json, **side}, extras)
        report.update(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      files=info["files"], total_size=info["total_size"],
                      written_files=sorted({*(f.name for f in tmp.iterdir() if f.is_file()), REPORT_FILE}))
        write_json(tmp / REPORT_FILE, report)
    return out_dir


def _write_files(tmp: Path, model: nn.Module, tokenizer, configs: dict, extras: dict) -> None:
    """config.json, generation_config.json, the format's side files, tokenizer files, ``extra_files``."""
    write_json(tmp / CONFIG_FILE, configs.pop(CONFIG_FILE))
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        with writing(tmp / "generation_config.json"):
            gen.save_pretrained(str(tmp))
    for name, obj in configs.items():
        write_json(tmp / name, obj)
    if tokenizer is not None:
        with writing(tmp / "tokenizer files"):
            tokenizer.save_pretrained(str(tmp))
    for name, obj in extras.items():
        if (tmp / name).exists():
            raise ValueError(f"extra_files key {name!r}: the export already wrote a file of that name")
        write_json(tmp / name, obj)


class _Only(nn.Module):
    """A model holding only the module at ``path`` (its names as in the full model) and the full model's config."""

    def __init__(self, config, path: str, module: nn.Module):
        super().__init__()
        self.config = config
        head, _, leaf = path.partition(".")
        if not leaf:
            self.add_module(head, module)
        else:
            self.add_module(head, _Only(None, leaf, module))


def layer_tensors(model: nn.Module, path: str, format: str = "compressed-tensors") -> dict[str, torch.Tensor]:
    """The tensors ``export_checkpoint`` writes for the module at ``path`` (one decoder layer, e.g.
    "model.layers.3"), under the same names and with the same values, computed from that module alone
    (the rest of ``model`` may be on the meta device) and checked as ``export_checkpoint`` checks them.
    Their order is not the checkpoint's (that comes from the whole model). Streaming PTQ writes these
    per layer and hands them back through ``export_checkpoint(tensor_source=)``."""
    fmt = format_named(format)
    part = _Only(model.config, path, model.get_submodule(path))
    view = experts_view(part)
    quantized, _high, linears = _collect(part, view)
    if not quantized:
        return {k: t.detach() for k, t in export_state(part, view).items()}
    schemes = {n: scheme_of(m) for n, m in quantized.items()}
    plan = export_plan.plan(part, fmt, quantized, schemes, kv_modules(part), linears)
    return export_plan.tensors(plan, quantized, fmt, export_state(part, view))


__all__ = ["export_checkpoint", "layer_tensors", "REPORT_FILE"]
