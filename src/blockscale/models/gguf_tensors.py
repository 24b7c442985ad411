"""A GGUF file's tensors under the transformers checkpoint names, read and dequantized a few at a time (streaming
PTQ of a GGUF source, ``models.hf_streaming``).

transformers loads a GGUF of a "legacy" architecture (llama, qwen2, mistral, ...: those its newer packed-GGUF path
does not handle) with ``load_gguf_checkpoint``: for every tensor of the file, ``gguf.dequantize`` of its blocks,
the architecture's ``TensorProcessor`` (Llama: the reverse of llama.cpp's q / k row permutation), the GGUF name
mapped to the model's (``get_gguf_hf_weights_map``), ``torch.from_numpy(np.copy(...))`` cast to the load dtype.
``GGUFTensors`` parses the file once (``gguf.GGUFReader``: names, types, offsets; seconds for a large file) and runs
exactly those steps per tensor, on the tensors asked for only, each through a memory map of that tensor's bytes
that is closed right after (mapped pages count in the RSS while mapped), so a streamed GGUF equals the one
``from_pretrained(gguf_file=...)`` loads bit for bit, one layer in memory at a time.

Streamable are the architectures whose processor turns one GGUF tensor into one transformers tensor
(``why_not_streamable``); MoE GGUFs (their processors merge the experts' tensors across the file) and the packed
path's architectures are not: their callers load them whole.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..errors import CheckpointError
from ..file_errors import reading

#: transformers' GGUF tensor processors that map one GGUF tensor to one transformers tensor
PER_TENSOR_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor")


def _reader(path: Path):
    from gguf import GGUFReader

    with reading(path, "GGUF file"):
        try:
            return GGUFReader(str(path))
        except (ValueError, KeyError, IndexError, EOFError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def _index(path: Path) -> tuple:
    """(architecture, [(name, byte offset, numpy dtype, array shape, GGML type, torch shape)]) of the GGUF file,
    parsed once per file version (``GGUFReader`` takes seconds on a large vocabulary), the mapping dropped."""
    st = Path(path).stat()
    return _index_of(str(Path(path).absolute()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _index_of(path: str, _size: int, _mtime: int) -> tuple:
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = _reader(Path(path))
    arch = read_field(reader, "general.architecture")
    if not arch:
        raise CheckpointError(f"{path}: the GGUF file has no general.architecture")
    tensors = [(t.name, int(t.data_offset), t.data.dtype, tuple(t.data.shape), t.tensor_type,
                tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors]
    del reader
    return str(arch[0]), tensors


def why_not_streamable(path: Path) -> Optional[str]:
    """Why the GGUF file ``path`` cannot be read a layer at a time (its architecture's tensors are merged or
    packed by transformers across the file), or None when it can."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    try:
        from transformers.integrations.gguf import GGUF_ARCHS
    except ImportError:  # transformers without the packed-GGUF path
        GGUF_ARCHS = {}
    arch = _index(path)[0]
    if arch in GGUF_ARCHS:
        return f"GGUF architecture {arch!r} loads through transformers' packed-GGUF path"
    proc = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if proc.__name__ not in PER_TENSOR_PROCESSORS:
        return f"GGUF architecture {arch!r}: transformers assembles its tensors across the file ({proc.__name__})"
    return None


class GGUFTensors:
    """The tensors of the GGUF file ``path`` for the (meta-device) transformers ``model`` built from its config:
    ``keys`` {checkpoint key: GGUF tensor name}, ``read(keys)`` {key: tensor in ``dtype``} (see the module
    docstring), ``nbytes(key)`` the bytes the read tensor takes."""

    def __init__(self, path: Path, model, dtype: torch.dtype):
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map, load_gguf_checkpoint)

        why = why_not_streamable(path)
        if why is not None:
            raise CheckpointError(f"{path}: {why}; it cannot be streamed")
        self.path, self.dtype = Path(path), dtype
        with reading(path, "GGUF file"):
            config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        arch, tensors = _index(path)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
        mapping = get_gguf_hf_weights_map(model, self.processor)
        self.keys: dict[str, str] = {}
        self._shapes: dict[str, tuple] = {}
        self._where: dict[str, tuple] = {}  # key -> (byte offset, numpy dtype, array shape, GGML type)
        for name, offset, dtype, shape, ggml_type, torch_shape in tensors:
            if name in mapping:
                key = mapping[name]
                self.keys[key], self._shapes[key] = name, torch_shape
                self._where[key] = (offset, dtype, shape, ggml_type)

    def nbytes(self, key: str) -> int:
        n = 1
        for d in self._shapes[key]:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """{checkpoint key: its tensor} as ``load_gguf_checkpoint`` makes it, for ``keys`` only."""
        import numpy as np
        from gguf import dequantize

        out = {}
        for key in keys:
            offset, dtype, shape, ggml_type = self._where[key]
            with reading(self.path, "GGUF file"):
                data = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)
                try:
                    weights = dequantize(data, ggml_type)
                finally:
                    del data
            result = self.processor.process(weights=weights, name=self.keys[key], tensor_key_mapping=None,
                                            parsed_parameters=None)
            out[key] = torch.from_numpy(np.copy(result.weights)).to(self.dtype)
        return out


__all__ = ["GGUFTensors", "PER_TENSOR_PROCESSORS", "why_not_streamable"]
