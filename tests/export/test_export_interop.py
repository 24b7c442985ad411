"""Interop with the reference compressed-tensors stack on CPU: its pydantic schema accepts our
quantization_config, and transformers (compressed-tensors quantizer, ``dequantize=True``) loads our
export with dense weights equal to NVFP4Linear's.

compressed-tensors decompresses NVFP4 through bfloat16 (``unpack_fp4_from_uint8`` defaults to bf16 and
``NVFP4PackedCompressor.decompress`` returns that dtype) as ``q * fl(s / S)``; we compute
``fl(q * s * fl(1/S))`` in FP32. The two FP32 values differ by at most an ulp, which the bf16 rounding
hides here, so the comparison is made in bf16 (an FP32 comparison cannot hold by construction).
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from blockscale.export import export_checkpoint  # noqa: E402
from blockscale.nn import NVFP4Linear  # noqa: E402

from nvfp4_checkpoints import CT, make_model, model_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


@pytest.mark.parametrize("act", [None, "6"])
def test_compressed_tensors_schema_accepts_our_config(tmp_path, act):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    out = export_checkpoint(make_model(layers=1, act=act), tmp_path / "ck", CT)
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(ours)
    preset = preset_name_to_scheme("NVFP4" if act else "NVFP4A16", ["Linear"])
    group = parsed.config_groups["group_0"]
    assert group.weights == preset.weights and group.input_activations == preset.input_activations
    assert parsed.format == "nvfp4-pack-quantized" and parsed.quantization_status == "compressed"
    dumped = parsed.model_dump()
    for key, value in dumped.items():
        if key == "config_groups":
            assert json.loads(json.dumps(value, default=str)) == ours[key]
        else:
            assert ours[key] == value, key


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transformers_loads_our_export(tmp_path, dtype):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = make_model(dtype, bias=True, tied=False)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    hf = AutoModelForCausalLM.from_pretrained(str(out), quantization_config=CompressedTensorsConfig(dequantize=True),
                                              dtype=dtype).eval()
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            dense = hf.get_submodule(name)
            assert type(dense) is torch.nn.Linear and dense.weight.dtype == dtype
            assert torch.equal(dense.weight.to(torch.bfloat16), m.dequantized_weight(torch.bfloat16)), name
            assert torch.equal(dense.bias, m.bias)
            n += 1
    assert n == 14
    for name, p in model.state_dict().items():
        if not any(name.startswith(q + ".") for q, m in model.named_modules() if isinstance(m, NVFP4Linear)):
            assert torch.equal(hf.state_dict()[name], p), name
    if dtype == torch.bfloat16:  # same dense weights, same model: same logits bit for bit
        assert torch.equal(model_logits(hf), model_logits(model))
