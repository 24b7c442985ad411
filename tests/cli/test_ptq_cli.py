"""`blockscale quantize` / `blockscale eval ppl` on the real stories260K model, and the known perplexity."""
from __future__ import annotations

import json

import pytest
import torch

from blockscale import cli
from blockscale.models import load_stories260k
from blockscale.models.hf import load_model
from blockscale.data.paths import data_root

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_stories260k_as_transformers_llama_keeps_its_logits_and_known_ppl(capsys, tmp_path, stories260k):
    lm = stories260k
    ours = load_stories260k(data_root() / "stories260K" / "stories260K.bin")
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = lm.model(ids).logits, ours(ids)
    assert float((a - b).abs().max()) < 1e-4 * float(b.abs().max())  # RoPE row permutation: fp32 rounding only
    # the data README's number: ppl 5.05 at ctx 512, one BOS before the stream
    out = tmp_path / "ppl.json"
    assert cli.main(["eval", "ppl", "stories260k", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["ctx"] == 512 and rec["bos"] == "stream" and rec["tokens_evaluated"] == 392251
    assert abs(rec["ppl"] - 5.048) < 1e-3


def test_quantize_export_then_eval_the_checkpoint(capsys, tmp_path):
    out = tmp_path / "ckpt"
    args = ["quantize", "stories260k", "--method", "gptq", "--scale-rule", "4over6", "--w4a4", "--skip-indivisible",
            "--n-samples", "8", "--seq-len", "64", "--format", "modelopt", "--out", str(out),
            "--eval", "tinystories#0:0.05"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "wrote modelopt checkpoint" in printed
    report = json.loads((out / "ptq_report.json").read_text())
    assert report["ptq"]["config"]["method"] == "gptq" and len(report["ptq"]["linears"]) == 30
    assert (out / "hf_quant_config.json").is_file() and (out / "blockscale_report.json").is_file()
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    # the reloaded checkpoint scores exactly what the in-memory model scored
    assert cli.main(["eval", "ppl", str(out), "--data", "tinystories#0:0.05", "--ctx", "512", "--bos", "stream",
                     "--json", str(tmp_path / "r.json")]) == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["loss"] == report["perplexity"]["loss"] and rec["tokens_evaluated"] == report["perplexity"]["tokens_evaluated"]
    assert 3.0 < rec["ppl"] < 8.0
    # an existing output directory is not overwritten without --overwrite
    assert cli.main(args) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_cli_errors(capsys, tmp_path):
    assert cli.main(["quantize", "stories260k", "--no-skip-indivisible", "--out", str(tmp_path / "x")]) == 1  # runtime
    err = capsys.readouterr().err
    assert "not a multiple of 16" in err and "--skip-indivisible" in err
    assert not (tmp_path / "x").exists()
    assert cli.main(["eval", "ppl", "no-such-model"]) == 2
    assert "not a built-in name" in capsys.readouterr().err
    assert cli.main(["eval", "ppl", "stories260k", "--threads", "0"]) == 2
    assert "--threads 0: must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", "ppl", "stories260k", "--max-tokens", "-5"]) == 2
    assert "--max-tokens -5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", "stories260k", "--out", str(tmp_path / "y"), "--method", "hqq"])


def test_local_transformers_directory(tmp_path, capsys):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg).eval()
    src.save_pretrained(tmp_path / "llama")  # weights and config only: no tokenizer
    lm = load_model(str(tmp_path / "llama"))
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, src(ids).logits)
    assert lm.tokenizer is None
    assert cli.main(["quantize", str(tmp_path / "llama"), "--out", str(tmp_path / "q")]) == 0  # RTN W4A16
    assert (tmp_path / "q" / "model.safetensors").is_file()
    assert cli.main(["quantize", str(tmp_path / "llama"), "--method", "gptq", "--out", str(tmp_path / "g")]) == 2
    assert "no tokenizer" in capsys.readouterr().err
