"""`blockscale quantize` on inputs a careless user gives (issue 29): each is one line before any work, naming
the file, flag or recipe rule at fault, never "internal error" and never a misleading hint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockscale.cli.main import main
from tiny_models import tiny_hf_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _save(d: Path, tokenizer: bool = True) -> Path:
    tiny_hf_llama().save_pretrained(d)
    if tokenizer:
        from blockscale.models.hf_moe_export import byte_transformers_tokenizer

        byte_transformers_tokenizer().save_pretrained(d)
    return d


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockscale")]


def _truncate_json(f: Path):
    f.write_text(f.read_text()[:200])


def _unreadable_model(f: Path):
    t = json.loads(f.read_text())
    t["model"]["type"] = "NoSuchModel"  # valid JSON the tokenizers library refuses with a bare Exception
    f.write_text(json.dumps(t))


@pytest.mark.parametrize("damage,message", [
    (_truncate_json, "tokenizer.json: not valid JSON"),
    (_unreadable_model, "tokenizer.json: not a tokenizer the tokenizers library reads"),
], ids=["truncated", "refused-by-tokenizers"])
@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_corrupt_tokenizer_is_named_not_called_missing(tmp_path, capsys, damage, message, streaming):
    src = _save(tmp_path / "src")
    damage(src / "tokenizer.json")
    argv = ["quantize", str(src), "--method", "gptq", "--out", str(tmp_path / "out")]
    assert main(argv + (["--streaming"] if streaming else [])) == 1
    err = _errors(capsys)
    assert len(err) == 1 and str(src / "tokenizer.json") in err[0] and message in err[0], err
    assert "has no tokenizer" not in err[0] and not (tmp_path / "out").exists()


def test_tokenizer_needing_custom_code_is_one_clear_line(tmp_path, capsys):
    src = _save(tmp_path / "src")
    assert main(["quantize", str(src), "--out", str(tmp_path / "q")]) == 0
    cfg = json.loads((tmp_path / "q" / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", None]}, tokenizer_class="XTokenizer")
    (tmp_path / "q" / "tokenizer_config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["eval", "ppl", str(tmp_path / "q"), "--max-tokens", "64"]) == 1
    err = _errors(capsys)
    assert len(err) == 1 and "its tokenizer needs custom code (tokenizer_config.json auto_map), which blockscale " \
                              "never runs" in err[0], err


def test_no_tokenizer_hint_names_what_calibrates(tmp_path, capsys):
    src = _save(tmp_path / "src", tokenizer=False)
    assert main(["quantize", str(src), "--method", "rtn", "--recipe", "fp8", "--out", str(tmp_path / "o")]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "the static activation / KV-cache scales of --recipe fp8 calibrates on text" in err[0]
    assert "--method rtn" not in err[0] and "use a recipe without static scales" in err[0]
    assert main(["quantize", str(src), "--method", "gptq", "--w4a4", "--out", str(tmp_path / "o")]) == 2
    err = _errors(capsys)
    assert "--method gptq and the static activation scales of --w4a4 calibrate on text" in err[0]
    assert "use --method rtn with W4A16 (no --w4a4)" in err[0]


def test_recipe_rule_matching_nothing_is_named_in_a_warning(tmp_path, capsys):
    src = _save(tmp_path / "src")
    (tmp_path / "r.yaml").write_text("name: typo\ndefault: nvfp4-w4a16\nrules:\n"
                                     "  - {match: '*.self_atn.*', scheme: mxfp4-w4a16}\n"
                                     "  - {match: attention, scheme: nvfp4-w4a16}\n")
    assert main(["quantize", str(src), "--recipe", str(tmp_path / "r.yaml"), "--method", "rtn", "--out",
                 str(tmp_path / "o")]) == 0
    warns = [line for line in _errors(capsys) if ": warning: " in line]
    assert len(warns) == 1 and "recipe 'typo': rule 0 (match '*.self_atn.*' -> mxfp4-w4a16) selects no module" in warns[0]
    report = json.loads((tmp_path / "o" / "ptq_report.json").read_text())
    assert any("rule 0" in w for w in report["ptq"]["warnings"])


def test_recipe_the_format_cannot_store_is_refused_before_loading(tmp_path, capsys):
    src = _save(tmp_path / "src")
    (tmp_path / "r.yaml").write_text("name: blocks\ndefault: nvfp4-w4a4\nrules:\n"
                                     "  - {match: attention, scheme: fp8-block}\n")
    assert main(["quantize", str(src), "--recipe", str(tmp_path / "r.yaml"), "--method", "gptq", "--format",
                 "modelopt", "--out", str(tmp_path / "o")]) == 2
    out, err = capsys.readouterr()
    assert "loading" not in out
    assert "format='modelopt' (--format) cannot store recipe 'blocks': rule 0 ('attention'): scheme fp8-block" in err


def test_moe_routing_to_more_experts_than_exist_is_refused(tmp_path, capsys):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=6)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "src")
    for extra in ([], ["--streaming"]):
        assert main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "o"), *extra]) == 1
        err = _errors(capsys)
        assert len(err) == 1 and "config.json: num_experts_per_tok=6 must be between 1 and num_local_experts=4" \
            in err[0], err


def test_offload_activations_naming_a_file_is_a_usage_error(tmp_path, capsys):
    src = _save(tmp_path / "src")
    (tmp_path / "f").write_text("mine")
    assert main(["quantize", str(src), "--streaming", "--offload-activations", str(tmp_path / "f"), "--out",
                 str(tmp_path / "o")]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "exists and is not a directory" in err[0] and (tmp_path / "f").read_text() == "mine"
