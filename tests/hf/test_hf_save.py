"""``save_pretrained`` of a model quantized on load writes blockscale's compressed-tensors export, the same as
``bs.export_checkpoint(model, dir, format="compressed-tensors")``; ``bs.load`` reloads it bit for bit and plain
transformers (with compressed-tensors) loads and runs it."""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import blockscale as bs  # noqa: E402
from blockscale.errors import UsageError  # noqa: E402
from blockscale.nn.quantized_modules import QUANTIZED_LINEAR_TYPES  # noqa: E402

from hf_on_load import on_load, saved, state_differences, tiny_llama  # noqa: E402
from tiny_models import checkpoint_tensors, logits, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


def _quantized(tmp_path, **config):
    return on_load(saved(tiny_llama(), tmp_path / "fp"), bs.BlockscaleConfig(**config))


def _files(path) -> set:
    return {f.name for f in path.iterdir()}


def _report(path) -> dict:
    report = json.loads((path / "blockscale_report.json").read_text())
    del report["created"]
    return report


@pytest.mark.parametrize("config", [dict(recipe="nvfp4", scale_rule="4over6"), dict(recipe="mxfp4")],
                         ids=["nvfp4-4over6", "mxfp4-w4a4"])
def test_hf_save_pretrained_is_the_export(tmp_path, config):
    model = _quantized(tmp_path, **config)
    model.save_pretrained(tmp_path / "saved")
    bs.export_checkpoint(model, tmp_path / "exported", format="compressed-tensors")
    a, b = tmp_path / "saved", tmp_path / "exported"
    assert _files(a) == _files(b) == {"config.json", "generation_config.json", "model.safetensors",
                                      "blockscale_report.json"}
    assert state_differences(checkpoint_tensors(a), checkpoint_tensors(b)) == []
    for name in ("config.json", "generation_config.json"):
        assert (a / name).read_text() == (b / name).read_text()
    assert _report(a) == _report(b)
    assert json.loads((a / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    back = bs.load(a)
    assert state_differences(back, model) == []
    x = token_ids(2, 16)
    assert torch.equal(logits(back, x), logits(model, x))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hf_saved_model_loads_in_plain_transformers(tmp_path):
    """compressed-tensors decompresses the NVFP4 weights to bfloat16: its dense weights equal ours dequantized
    to bfloat16 bit for bit, and plain ``from_pretrained(dir)`` generates."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = _quantized(tmp_path, recipe="nvfp4", scale_rule="4over6")
    model.save_pretrained(tmp_path / "q")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, QUANTIZED_LINEAR_TYPES):
            theirs = dense.get_submodule(name)
            assert type(theirs) is torch.nn.Linear
            assert torch.equal(theirs.weight, m.dequantized_weight(torch.bfloat16)), name
            n += 1
    assert n == 14
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    ids = token_ids(2, 8)
    out = plain.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 11) and torch.equal(out[:, :8], ids)
    diff = (logits(plain, ids).float() - logits(model, ids)).abs().max()
    assert diff < 0.05, float(diff)  # bf16 against fp32 on the same weights (W4A16)


def test_hf_save_into_a_directory_with_other_files(tmp_path):
    """As save_pretrained: a tokenizer saved first (and anything else) stays; saving again replaces the export's
    files, and shards of an earlier save that this one does not write are removed."""
    model = _quantized(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer_config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    model.save_pretrained(out, max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert (out / "notes.txt").read_text() == "mine" and (out / "tokenizer_config.json").read_text() == "{}"
    model.save_pretrained(out)
    assert _files(out) == {"config.json", "generation_config.json", "model.safetensors", "blockscale_report.json",
                           "tokenizer_config.json", "notes.txt"}
    assert not list(tmp_path.glob(".out.save-*"))  # the staging directory is gone
    assert torch.equal(logits(bs.load(out), token_ids(2, 8)), logits(model, token_ids(2, 8)))


def test_hf_save_arguments(tmp_path):
    model = _quantized(tmp_path)
    model.save_pretrained(tmp_path / "a", state_dict=model.state_dict(), is_main_process=True)  # as Trainer calls it
    assert (tmp_path / "a" / "model.safetensors").is_file()
    model.save_pretrained(tmp_path / "b", is_main_process=False)
    assert not (tmp_path / "b").exists()
    with pytest.raises(UsageError, match="push_to_hub=True"):
        model.save_pretrained(tmp_path / "c", push_to_hub=True)
    with pytest.raises(UsageError, match=r"state_dict=\.\.\.\): blockscale exports the model's own modules"):
        model.save_pretrained(tmp_path / "c", state_dict={})
    with pytest.raises(UsageError, match=r"unsupported argument\(s\) \['variant'\]"):
        model.save_pretrained(tmp_path / "c", variant="x")
    assert not (tmp_path / "c").exists()
