"""examples/qat_transformers_trainer.py: ``bs.convert`` + a plain transformers ``Trainer`` for a few steps on a
tiny Llama, then the quantized export, which ``bs.load`` reads back as the model that was exported."""
import copy
import math
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (transformers' Trainer needs it)

import blockscale as bs  # noqa: E402
from blockscale.data.tokenizer import ByteTokenizer  # noqa: E402
from blockscale.nn.quantized_modules import QUANTIZED_LINEAR_TYPES  # noqa: E402

from hf_on_load import state_differences, tiny_llama  # noqa: E402
from tiny_models import logits, token_ids  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qat_transformers_trainer.py"

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


def test_hf_qat_trainer_example_trains_and_exports(tmp_path):
    example = runpy.run_path(str(EXAMPLE))  # (not on sys.path: an example, not a module of the package)
    model = tiny_llama(vocab=256)
    untrained = copy.deepcopy(model)
    result = example["main"](model, tmp_path / "ck", tokenizer=ByteTokenizer(), steps=3, seq_len=32, batch_size=2)
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    assert "14 linear layers converted" in str(result.conversion)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_LINEAR_TYPES)}
    assert len(quantized) == 14  # the fine-tuned weights, quantized by PTQ (NVFP4 W4A16)
    bs.quantize_model(untrained, bs.PTQConfig(recipe="nvfp4"), progress=False)
    assert "model.layers.0.mlp.up_proj.weight_packed" in state_differences(untrained, model)  # the Trainer trained
    back = bs.load(result.checkpoint)
    assert state_differences(back, model) == []
    assert torch.equal(logits(back, token_ids(2, 16, vocab=256)), logits(model, token_ids(2, 16, vocab=256)))
