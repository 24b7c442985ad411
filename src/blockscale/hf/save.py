"""``save_quantized``: what ``model.save_pretrained(dir)`` does for a model quantized on load: blockscale's
compressed-tensors export, exactly what ``bs.export_checkpoint(model, dir, format="compressed-tensors")`` writes
(vLLM / SGLang / transformers with compressed-tensors load it; ``bs.load`` reloads it bit for bit).

Why the model instance's method is replaced: transformers' ``PreTrainedModel.save_pretrained`` writes the
state dict (after its own weight-name reversal and sharding) and config.json with the config's
``quantization_config.to_dict()``; its only quantizer hook, ``HfQuantizer.get_state_dict_and_metadata``, changes
the tensors but not config.json, the tensor layout a checkpoint format prescribes (packed codes, per-format
scale names, fused experts per expert) or the side files. So the quantizer sets ``model.save_pretrained`` to this
function (``types.MethodType``) after loading; the class's method is untouched.

As ``save_pretrained``, it writes into a directory that may hold other files (a tokenizer saved first): those
are kept, the files an export writes are replaced and weight files of an earlier save that this one does not
write are removed. An absent or empty directory is written atomically by ``export_checkpoint`` itself.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

from torch import nn

from ..errors import UsageError
from ..export import export_checkpoint
from ..export.destination import TOKENIZER_FILES, written_by_export

FORMAT = "compressed-tensors"


def _check_arguments(model: nn.Module, state_dict, safe_serialization, push_to_hub, extra: dict) -> None:
    if extra:
        raise UsageError(f"save_pretrained of a model quantized by blockscale: unsupported argument(s) "
                         f"{sorted(extra)}; it takes save_directory, is_main_process, state_dict (the model's own), "
                         "max_shard_size, tokenizer")
    if push_to_hub:
        raise UsageError("save_pretrained(push_to_hub=True) is not supported for a model quantized by blockscale: "
                         "save to a directory, then upload it (huggingface_hub.upload_folder)")
    if safe_serialization is False:
        raise UsageError("save_pretrained(safe_serialization=False): blockscale writes safetensors only")
    if state_dict is not None:
        own = model.state_dict()
        if set(state_dict) != set(own) or any(state_dict[k].data_ptr() != t.data_ptr() for k, t in own.items()):
            raise UsageError("save_pretrained(state_dict=...): blockscale exports the model's own modules; pass "
                             "state_dict=None (a state dict that is not the model's own cannot be exported)")


def _merge_into(out: Path, model: nn.Module, **export_args) -> None:
    """Export next to ``out`` and move the files in: what an export writes is replaced, weight and config
    files of an earlier save that this export does not write are removed, anything else is kept."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.save-", dir=out.parent))
    try:
        written = export_checkpoint(model, staging / "checkpoint", FORMAT, **export_args)
        names = {f.name for f in written.iterdir()}
        for old in out.iterdir():
            if old.is_file() and not old.is_symlink() and written_by_export(old.name) \
                    and old.name not in TOKENIZER_FILES and old.name not in names:
                old.unlink()
        for name in sorted(names):
            os.replace(written / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_quantized(model: nn.Module, save_directory: Union[str, os.PathLike], is_main_process: bool = True,
                   state_dict: Optional[dict] = None, max_shard_size: Union[int, str] = "2GB",
                   safe_serialization: bool = True, push_to_hub: bool = False, tokenizer=None, **kwargs) -> None:
    """Write ``model`` to ``save_directory`` as blockscale's compressed-tensors export (``bs.export_checkpoint``;
    ``max_shard_size`` and ``tokenizer`` are its arguments). ``is_main_process=False``: nothing is written (the
    other ranks of a distributed run). ``state_dict`` may only be the model's own (as ``Trainer`` passes it);
    ``push_to_hub`` and ``safe_serialization=False`` are refused, as are other arguments."""
    _check_arguments(model, state_dict, safe_serialization, push_to_hub, kwargs)
    if not is_main_process:
        return
    out = Path(save_directory)
    export_args = {"tokenizer": tokenizer, "max_shard_size": max_shard_size}
    if out.is_dir() and not out.is_symlink() and any(out.iterdir()):
        _merge_into(out, model, **export_args)
    else:
        export_checkpoint(model, out, FORMAT, **export_args)


__all__ = ["FORMAT", "save_quantized"]
