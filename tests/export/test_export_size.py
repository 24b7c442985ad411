"""``--dtype bfloat16`` end to end (quantize -> export -> ``blockscale.load`` bit for bit) and the size
summary: which bytes of a checkpoint are NVFP4 weights and which are high-precision tensors."""
import json

import pytest
import torch
from safetensors import safe_open

from blockscale import cli
from blockscale.export import load_checkpoint, size_breakdown
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig, quantize_model

from tiny_models import tiny_hf_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

# tiny Llama (vocab 96, hidden 64, kv 32, MLP 128, 2 layers, untied lm_head): per layer NVFP4 bytes =
# N*K/2 codes + N*K/16 E4M3 scales + 4 (S) for q, o [64x64], k, v [32x64], gate, up [128x64], down [64x128]
NVFP4_BYTES = 2 * sum(n * k // 2 + n * k // 16 + 4 for n, k in
                      [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)])
HIGH_ELEMENTS = 2 * 96 * 64 + (2 * 2 + 1) * 64  # embed_tokens + lm_head + 5 RMSNorm weights


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantize_dtype_end_to_end(tmp_path, capsys, dtype):
    src, out = tmp_path / "src", tmp_path / "ck"
    tiny_hf_llama().save_pretrained(src)
    assert cli.main(["quantize", str(src), "--method", "rtn", "--dtype", dtype, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    width = 2 if dtype == "bfloat16" else 4
    high = HIGH_ELEMENTS * width
    short = "bf16" if dtype == "bfloat16" else "fp32"
    line = (f"checkpoint {(NVFP4_BYTES + high) / 1e3:.1f} kB: NVFP4 weights {NVFP4_BYTES / 1e3:.1f} kB, "
            f"high-precision tensors {high / 1e3:.1f} kB "
            f"(largest: lm_head.weight {short} {96 * 64 * width / 1e3:.1f} kB)"
            f"; unquantized tensors are {dtype} (--dtype)")
    assert line in printed.splitlines()
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert st.get_slice("model.embed_tokens.weight").get_dtype() == ("BF16" if width == 2 else "F32")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["blockscale"]["dtype"] == dtype
    # the same quantization in memory: blockscale.load reproduces it bit for bit, in that dtype
    lm = load_model(str(src), dtype=getattr(torch, dtype))
    quantize_model(lm.model, PTQConfig(method="rtn"), progress=False)
    back = load_checkpoint(out)
    assert back.get_input_embeddings().weight.dtype == getattr(torch, dtype)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, lm.model(ids).logits)
    b = size_breakdown(out)
    assert (b.nvfp4, b.high_precision, b.total) == (NVFP4_BYTES, high, NVFP4_BYTES + high)
