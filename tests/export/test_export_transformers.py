"""Our exports in plain transformers, with no extra arguments: ``AutoModelForCausalLM.from_pretrained(dir)``
then ``generate`` (compressed-tensors' runtime decompresses NVFP4 weights to bfloat16, so config.json
records ``dtype: bfloat16``; ``quantization_config.blockscale.dtype`` keeps the model's own dtype, which
``blockscale.load`` uses by default to reproduce the in-memory logits bit for bit), and config.json keeps
the model's own ``use_cache`` rather than the evaluation-time ``False``.

Tolerance (``ATOL``, absolute, on logits of magnitude <= ~0.6): transformers runs the model in bfloat16
(relative rounding 2^-9 per op) while ours runs in FP32 on the same dequantized weights. W4A16: 0.02
(measured 0.0034). W4A4 also quantizes every Linear input to FP4 on the fly, and an input that bf16
rounding moves across an FP4 rounding boundary changes by a whole code step (up to 1/3 of its value),
so 0.15 (measured 0.068). Greedy tokens agree on these seeds.
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from blockscale.export import export_checkpoint, load_checkpoint  # noqa: E402

from nvfp4_checkpoints import CT, MO, make_model, model_logits, sample_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")
ATOL = {None: 0.02, "6": 0.15}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("act", [None, "6"], ids=["W4A16", "W4A4"])
def test_plain_from_pretrained_generates(tmp_path, act):
    from transformers import AutoModelForCausalLM

    model = make_model(act=act)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = sample_ids()
    gen = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (2, ids.shape[1] + 4) and torch.equal(gen[:, :ids.shape[1]], ids)
    ref = model_logits(model)
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert hf.dtype == torch.bfloat16
    assert (theirs - ref).abs().max() <= ATOL[act], float((theirs - ref).abs().max())
    ours = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen, ours)


@pytest.mark.parametrize("fmt", [CT, MO])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recorded_dtype_and_exact_reload(tmp_path, fmt, dtype):
    model = make_model(dtype)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    cfg = json.loads((out / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert cfg["quantization_config"]["blockscale"]["dtype"] == name
    assert cfg["dtype"] == ("bfloat16" if fmt == CT else name)
    back = load_checkpoint(out)
    assert back.get_input_embeddings().weight.dtype == dtype
    assert torch.equal(model_logits(back), model_logits(model))


@pytest.mark.parametrize("fmt", [CT, MO])
def test_config_keeps_models_own_use_cache(tmp_path, fmt):
    from blockscale.models.hf import load_model

    src = make_model()
    src.config.use_cache = True
    plain = tmp_path / "plain"
    import transformers
    fresh = transformers.AutoModelForCausalLM.from_config(src.config)
    fresh.save_pretrained(plain)
    loaded = load_model(str(plain)).model
    assert loaded.config.use_cache is False  # evaluation turns the cache off ...
    src.config.use_cache = False
    src.blockscale_use_cache = loaded.blockscale_use_cache
    out = export_checkpoint(src, tmp_path / "ck", fmt)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # ... the export restores it


def test_transformers_does_not_load_modelopt(tmp_path):
    """docs/ptq.md's statement: transformers has no quantizer for ``quant_method: modelopt``; it skips the
    quantization config and then refuses the packed uint8 ``weight`` [N, K/2] for the dense [N, K]."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert "modelopt" not in AUTO_QUANTIZER_MAPPING
    out = export_checkpoint(make_model(), tmp_path / "ck", MO)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(out)
