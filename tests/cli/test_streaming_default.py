"""Which sources ``blockscale quantize`` streams by default (issue 31: ``cli.quantize_streaming.streaming_decision``)
and the one line it prints where it cannot; the end-to-end runs are in tests/ptq/test_ptq_streaming*.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockscale.cli.quantize_streaming import streaming_decision
from blockscale.errors import UsageError


def _args(model, streaming=None, eval=None):
    return SimpleNamespace(model=str(model), streaming=streaming, eval=eval)


@pytest.fixture
def hf_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_local_directories_hub_names_and_the_builtin_gguf_stream(hf_dir):
    for model in (hf_dir, "Qwen/Qwen2.5-Coder-1.5B-Instruct", "smollm2-135m"):
        assert streaming_decision(_args(model)) == (True, None), model


def test_what_streaming_cannot_serve_falls_back_in_one_line(hf_dir, tmp_path, monkeypatch):
    (tmp_path / "pickles").mkdir()
    (tmp_path / "pickles" / "config.json").write_text("{}")
    cases = [(_args("stories260k"), "stories260k is not a transformers checkpoint"),
             (_args(hf_dir, eval="default"), "--eval measures perplexity on the whole model"),
             (_args(tmp_path / "pickles"), "streaming needs safetensors weights")]
    for args, why in cases:
        stream, line = streaming_decision(args)
        assert not stream and line.startswith(f"not streaming {args.model}: ") and why in line
        assert line.endswith("; loading it whole") and "\n" not in line
        with pytest.raises(UsageError, match="--streaming: "):
            streaming_decision(SimpleNamespace(**{**vars(args), "streaming": True}))
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: data-parallel calibration on the whole model, no line
    assert streaming_decision(_args(hf_dir)) == (False, None)
    with pytest.raises(UsageError, match="--streaming: under torchrun the ranks calibrate data-parallel"):
        streaming_decision(_args(hf_dir, streaming=True))


def test_no_streaming_always_loads_whole(hf_dir):
    assert streaming_decision(_args(hf_dir, streaming=False)) == (False, None)
