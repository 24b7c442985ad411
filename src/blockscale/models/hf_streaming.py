"""A transformers causal LM built on the meta device from a local directory of safetensors shards or a GGUF file
(``models.gguf_tensors``: the architectures transformers reads tensor by tensor), whose tensors are loaded on
demand: the embeddings / final norm / head once, each decoder layer only while it is processed (streaming PTQ,
``ptq.streaming``).

Loading goes through transformers' own engine, as ``from_pretrained`` does: the model class and its meta
init context (``get_init_context``), the dtype plan, the checkpoint conversion mapping (Mixtral's per-expert
``w1`` / ``w3`` / ``w2`` merged into ``gate_up_proj`` / ``down_proj``, renamings) and
``convert_and_load_state_dict_in_model``, fed only the keys wanted, each read from its memory-mapped shard
(``safe_open``) and the mapping closed at once (mapped pages count in the RSS while the file is open).
Non-persistent buffers (RoPE ``inv_freq``) are re-initialised with the model's ``_init_weights``, as
``from_pretrained`` does. So a loaded tensor equals the one ``models.hf.load_model`` gives, bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..errors import CheckpointError, UsageError
from ..file_errors import reading
from .routing_config import check_model_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return Path(path).suffix.lower() == ".gguf"


def check_source(path: Path) -> None:
    """UsageError / CheckpointError unless ``path`` is a source streaming can read: a local transformers
    safetensors directory (``shard_files``) or a GGUF file of a streamable architecture."""
    path = Path(path)
    if is_gguf(path):
        from .gguf_tensors import why_not_streamable

        if not path.is_file():
            raise UsageError(f"{path}: the GGUF file does not exist")
        why = why_not_streamable(path)
        if why is not None:
            raise UsageError(f"{path}: {why}, so it cannot be streamed; load it whole (--no-streaming)")
        return
    shard_files(path)


def shard_files(path: Path) -> dict[str, str]:
    """{checkpoint key: shard file name} of a local transformers directory of safetensors (UsageError otherwise)."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UsageError(f"{path}: streaming needs a local Hugging Face model directory (config.json and "
                         f"safetensors shards); got {'a missing path' if not path.exists() else 'no config.json'}")
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v and v.endswith(
                ".safetensors") for v in weight_map.values()):
            raise CheckpointError(f"{path / INDEX}: weight_map must map tensor names to safetensors file names in "
                                  "the same directory")
        return dict(weight_map)
    if (path / SINGLE).is_file():
        from safetensors import safe_open

        with reading(path / SINGLE, "safetensors file"), safe_open(str(path / SINGLE), framework="pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise UsageError(f"{path}: streaming needs safetensors weights ({SINGLE} or {INDEX}); found none")


class StreamingModel:
    """``model``: the transformers model on the meta device (eval mode, ``use_cache`` off as ``load_model``
    sets it); ``load(keys)`` materializes the checkpoint tensors with those names (checkpoint names, e.g.
    ``model.layers.3.block_sparse_moe.experts.0.w1.weight``); ``layer_keys(path)``: the checkpoint keys
    landing under module ``path``; ``load_module(path)``: those loaded; ``release(module, keep)``: its
    tensors back to meta (those for which ``keep(name, t)`` is true stay)."""

    def __init__(self, path, dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key
        from transformers.modeling_utils import LoadStateDictConfig, _get_dtype
        from transformers.models.auto.auto_factory import _get_model_class
        from transformers.utils.generic import ContextManagers

        self.path = Path(path)
        self.gguf = None
        if is_gguf(self.path):  # the config from the file's metadata, as from_pretrained(gguf_file=...) reads it
            check_source(self.path)
            config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name, trust_remote_code=False)
            check_model_config(config, self.path)
            files, self.files = [str(self.path)], {}
        else:
            self.files = shard_files(self.path)
            config = AutoConfig.from_pretrained(self.path, trust_remote_code=False)
            check_model_config(config, self.path / "config.json")
            files = sorted({str(self.path / f) for f in self.files.values()})
        cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)
        config, dtype = _get_dtype(dtype, files, config, None, None, True, None)
        config.name_or_path = self.path.parent if is_gguf(self.path) else self.path  # from_pretrained: the directory
        config = __import__("copy").deepcopy(config)
        with ContextManagers(cls.get_init_context(dtype, False, False, None)):
            model = cls(config)
        self.model = model
        self.dtype = dtype
        if is_gguf(self.path):
            from .gguf_tensors import GGUFTensors

            self.gguf = GGUFTensors(self.path, model, dtype)
            self.files = dict.fromkeys(self.gguf.keys, self.path.name)
        self._config = LoadStateDictConfig(pretrained_model_name_or_path=str(self.path), dtype=dtype,
                                           dtype_plan=model._get_dtype_plan(dtype),
                                           weight_mapping=get_model_conversion_mapping(model, None, None))
        mapping = self._config.weight_mapping or []
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        renamings = [e for e in mapping if isinstance(e, WeightRenaming)]
        converters = [e for e in mapping if isinstance(e, WeightConverter)]
        meta = model.state_dict()
        self.target: dict[str, str] = {}  # checkpoint key -> model key
        self.ignored: list[str] = []  # checkpoint keys no parameter or buffer takes (RoPE inv_freq of old exports)
        self.converted: set[str] = set()  # model keys a WeightConverter builds (e.g. experts merged per layer)
        for k in self.files:
            t, converter = rename_source_key(k, renamings, converters, model.base_model_prefix, meta)
            if t not in meta and k in meta:
                t, converter = k, None
            if t not in meta:
                self.ignored.append(k)
                continue
            self.target[k] = t
            if converter is not None:
                self.converted.add(t)
        warn_ignored(self.path, self._reported(self.ignored))
        self._open: dict[str, object] = {}
        self.bytes_read = 0

    def _reported(self, keys: list[str]) -> list[str]:
        """``keys`` less those ``from_pretrained`` ignores without a word (the model's
        ``_keys_to_ignore_on_load_unexpected`` and old exports' ``rotary_emb.inv_freq`` / ``position_ids``),
        by transformers' own rule, so both loading paths warn about the same tensors."""
        from transformers.modeling_utils import LoadStateDictInfo

        info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(keys), mismatched_keys=set(),
                                 error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
        self.model._adjust_missing_and_unexpected_keys(info)
        return sorted(info.unexpected_keys)

    # -- reading -----------------------------------------------------------------------------------
    def _slice(self, key: str):
        from safetensors import safe_open

        fname = self.files[key]
        with reading(self.path / fname, "safetensors file"):
            f = self._open.get(fname)
            if f is None:
                f = self._open[fname] = safe_open(str(self.path / fname), framework="pt", device="cpu")
            return f.get_slice(key)

    def _read(self, key: str) -> torch.Tensor:
        """One tensor copied out of its memory-mapped shard, the mapping closed at once (its pages would
        otherwise count in the RSS until the file is closed)."""
        from safetensors import safe_open

        path = self.path / self.files[key]
        with reading(path, "safetensors file"), safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def layer_keys(self, path: str) -> list[str]:
        return [k for k, t in self.target.items() if t.startswith(path + ".")]

    def load(self, keys: Iterable[str]) -> None:
        """Materialize the checkpoint tensors ``keys`` (and every non-persistent buffer of the modules they
        land in, initialised as ``from_pretrained`` does) in the model."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        keys = list(keys)
        self.bytes_read += sum(self._nbytes(k) for k in keys)
        self._open.clear()
        state = self.gguf.read(keys) if self.gguf is not None else {k: self._read(k) for k in keys}
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            info, _ = convert_and_load_state_dict_in_model(self.model, state, self._config)
        finally:
            del state
            self._open.clear()  # unmap the shards: their pages would stay resident (and in the RSS) while mapped
            if bars:
                hf_logging.enable_progress_bar()
        if info.unexpected_keys or info.mismatched_keys or info.conversion_errors or info.error_msgs:
            raise CheckpointError(f"{self.path}: could not load {len(keys)} tensor(s) into "
                                  f"{type(self.model).__name__}: unexpected {sorted(info.unexpected_keys)[:3]}, "
                                  f"mismatched {sorted(info.mismatched_keys)[:3]}, "
                                  f"{list(info.conversion_errors.values())[:1] or info.error_msgs[:1]}")

    def row_source(self, model_key: str) -> str:
        """The one checkpoint key holding model tensor ``model_key`` as it is (a renaming at most), for reading
        rows of it (``read_rows``); UsageError when transformers builds it from several tensors or none."""
        if model_key in self.converted:
            raise UsageError(f"{self.path}: {model_key} is built by transformers from several checkpoint tensors "
                             "(e.g. per-expert weights merged), so its rows cannot be read on their own; load this "
                             "model without --fsdp")
        keys = [k for k, t in self.target.items() if t == model_key]
        if len(keys) != 1:
            raise CheckpointError(f"{self.path}: {'no' if not keys else len(keys)} checkpoint tensor(s) for "
                                  f"{model_key}")
        return keys[0]

    def read_rows(self, model_key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (dim 0) of model tensor ``model_key`` in the model's dtype: a safetensors
        source reads only those rows' bytes (``get_slice``); a GGUF source dequantizes the whole tensor
        (its quantized blocks and transformers' reordering of Q / K rows span rows) and keeps the rows.
        ``bytes_read`` counts what was read."""
        key = self.row_source(model_key)
        if self.gguf is not None:
            self.bytes_read += self.gguf.nbytes(key)
            return self.gguf.read([key])[key][start:stop].clone()
        path = self.path / self.files[key]
        with reading(path, "safetensors file"), safe_open_rows(path) as f:
            part = f.get_slice(key)[start:stop]
        self.bytes_read += part.numel() * part.element_size()
        return part

    def _nbytes(self, key: str) -> int:
        if self.gguf is not None:
            return self.gguf.nbytes(key)
        s = self._slice(key)
        n = 1
        for d in s.get_shape():
            n *= d
        return n * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1,
                    "F8_E4M3": 1, "F8_E5M2": 1}.get(s.get_dtype(), 4)

    def init_buffers(self, root: str = "") -> None:
        """Non-persistent buffers under module ``root`` ("" = outside every meta module already) made real
        and initialised by the model's ``_init_weights`` (RoPE ``inv_freq``), as ``from_pretrained`` does."""
        model = self.model
        owners = {}
        for name, buf in list(model.named_buffers()):
            mod_name, _, leaf = name.rpartition(".")
            if buf.device.type != "meta" or (root and not name.startswith(root + ".")):
                continue
            mod = model.get_submodule(mod_name)
            if leaf in mod._non_persistent_buffers_set:
                mod._buffers[leaf] = torch.empty_like(buf, device="cpu")
                owners[mod_name] = mod
        for mod in owners.values():
            model._init_weights(mod)

    def load_module(self, path: str) -> None:
        keys = self.layer_keys(path)
        if not keys:
            raise CheckpointError(f"{self.path}: no tensor of the checkpoint belongs to {path}")
        self.load(keys)
        self.init_buffers(path)
        missing = [n for n, t in self.model.get_submodule(path).state_dict().items() if t.device.type == "meta"]
        if missing:
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor for {path}.{missing[0]} "
                                  f"({len(missing)} missing)")

    def load_outside(self, layers_path: str) -> None:
        """Everything outside the decoder layers (embeddings, final norm, head), tied weights tied."""
        self.load([k for k, t in self.target.items() if not t.startswith(layers_path + ".")])
        self.model.tie_weights()
        self.init_buffers()
        for name, t in self.model.state_dict().items():
            if t.device.type == "meta" and not name.startswith(layers_path + "."):
                raise CheckpointError(f"{self.path}: the checkpoint has no tensor for {name}")

    def close(self) -> None:
        self._open.clear()


def safe_open_rows(path: Path):
    """``safe_open`` of one safetensors file (CPU tensors), closed by its ``with``."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")


def warn_ignored(source, keys: list[str]) -> None:
    """One warning for checkpoint tensors no parameter or buffer of the model takes (both loading paths
    ignore them, as ``from_pretrained`` does: e.g. ``self_attn.rotary_emb.inv_freq`` in old Llama exports)."""
    if keys:
        import warnings

        warnings.warn(f"{source}: {len(keys)} checkpoint tensor(s) match no parameter or buffer of the model and "
                      f"are ignored (e.g. {sorted(keys)[0]})", stacklevel=3)


def release(module: nn.Module, keep: Optional[Callable[[str, torch.Tensor], bool]] = None) -> None:
    """Every parameter and buffer of ``module`` replaced by a meta tensor of its shape and dtype, except
    those ``keep(name, tensor)`` keeps."""
    for mname, m in module.named_modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None or t.device.type == "meta":
                    continue
                full = f"{mname}.{name}" if mname else name
                if keep is not None and keep(full, t):
                    continue
                empty = torch.empty_like(t, device="meta")
                store[name] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                    else empty


def trim_heap() -> None:
    """Give the freed heap back to the system (glibc keeps a released layer's pages otherwise, and the RSS
    would grow by a fraction of a layer per layer); a no-op where it does not apply (not glibc)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def real_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that are not on the meta device (each tensor once)."""
    seen, n = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


__all__ = ["StreamingModel", "check_source", "is_gguf", "real_bytes", "release", "shard_files", "trim_heap", "warn_ignored"]
