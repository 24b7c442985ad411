"""Writing checkpoints safely: ``overwrite`` replaces only a blockscale checkpoint holding nothing
else, never the model being read; stale temporary directories of our own naming are cleaned; files
describing the run are written inside the atomic directory; every file gets 0o666 & ~umask; modules
whose weight matrices stay in high precision (fused 3-D MoE experts, routers) are listed in
``ignore`` / ``exclude_modules`` and in the report with their share of the weight elements."""
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import torch

import blockscale as bs
from blockscale.export import destination, export_checkpoint, is_blockscale_export
from blockscale.nn import NVFP4Linear
from blockscale.nn.fused import fused_groups
from blockscale.quant.nvfp4 import outer_scale

from nvfp4_checkpoints import CT, MO, VOCAB, make_model, model_logits, replace_module  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


@pytest.fixture(scope="module")
def tiny():
    return make_model(layers=1)


def _tree(root: Path) -> dict:
    """{relative path: bytes} of every file under ``root`` (hidden ones included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- overwrite: only our own checkpoints, holding nothing else -----------------------------------
@pytest.mark.parametrize("extra,named", [
    ({"sub/notes.txt": "my notes"}, "sub/"),             # the probe: a user's sub/notes.txt was deleted
    ({"notes.txt": "my notes"}, "notes.txt"),
    ({"README.md": "# card", "data/x.bin": "1"}, "README.md, data/"),
])
def test_overwrite_refuses_a_checkpoint_holding_user_files(tmp_path, tiny, extra, named):
    out = export_checkpoint(tiny, tmp_path / "ck", CT)
    for rel, text in extra.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(out))}.*holds files a blockscale export does not write \({named}\)"
                                              r".*remove or rename"):
        export_checkpoint(tiny, out, MO, overwrite=True)
    assert _tree(tmp_path) == before  # nothing deleted, no temporary directory left


def test_overwrite_refuses_a_symlink_entry(tmp_path, tiny):
    out = export_checkpoint(tiny, tmp_path / "ck", CT)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    os.symlink(tmp_path / "mine", out / "link")
    with pytest.raises(FileExistsError, match=r"does not write \(link \(symbolic link\)\)"):
        export_checkpoint(tiny, out, CT, overwrite=True)
    assert (tmp_path / "mine" / "keep.txt").read_text() == "x" and (out / "link").is_symlink()


def test_out_dir_that_is_a_symlink_is_refused(tmp_path, tiny):
    real = export_checkpoint(tiny, tmp_path / "real", CT)
    os.symlink(real, tmp_path / "alias")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=rf"alias is a symbolic link \(to {re.escape(str(real))}\)"):
        export_checkpoint(tiny, tmp_path / "alias", CT, overwrite=True)
    assert _tree(tmp_path) == before and (tmp_path / "alias").is_symlink()


@pytest.mark.parametrize("kind", ["hf-model", "user-files", "empty-config"])
def test_overwrite_refuses_a_directory_that_is_not_ours(tmp_path, tiny, kind):
    out = tmp_path / "d"
    out.mkdir()
    if kind == "hf-model":  # a plain (unquantized) transformers checkpoint
        transformers.AutoModelForCausalLM.from_config(tiny.config).save_pretrained(str(out))
    elif kind == "user-files":
        (out / "thesis.tex").write_text("x")
    else:
        (out / "config.json").write_text(json.dumps({"quantization_config": {"blockscale": "yes"}}))
    assert not is_blockscale_export(out)
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(out))} exists, is not empty and is not a blockscale checkpoint.*"
                                              "remove or rename it yourself"):
        export_checkpoint(tiny, out, CT, overwrite=True)
    with pytest.raises(FileExistsError, match="not a blockscale checkpoint"):
        with destination.atomic_directory(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("{}")
    assert _tree(tmp_path) == before


def test_overwrite_replaces_our_own_checkpoint(tmp_path, tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    out = export_checkpoint(tiny, tmp_path / "ck", MO, tokenizer=fast, max_shard_size="8KB",
                            extra_files={"ptq_report.json": {"a": 1}, "eval_results.json": [1, 2]})
    (out / "lsq_report.json").write_text("{}")  # written by older versions after the rename
    assert is_blockscale_export(out) and len(list(out.glob("model-*.safetensors"))) > 1
    with pytest.raises(FileExistsError, match=r"not empty; pass overwrite=True"):
        export_checkpoint(tiny, out, CT)
    export_checkpoint(tiny, out, CT, overwrite=True)
    assert bs.export.checkpoint_format(out) == CT and not (out / "eval_results.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("files,ours", [
    ({"config.json": {"quantization_config": {"blockscale": {"format": CT, "version": "0.1"}}}}, True),
    ({"blockscale_report.json": {"producer": {"name": "blockscale", "version": "0.1"}}}, True),
    ({"blockscale_report.json": {"producer": {"name": "llm-compressor"}}}, False),
    ({"blockscale_report.json": {"producer": "blockscale"}}, False),
    ({"config.json": {"quantization_config": {"blockscale": {"format": "gguf", "version": "0.1"}}}}, False),
    ({"config.json": {"quantization_config": {"quant_method": "compressed-tensors"}}}, False),
    ({"config.json": [1, 2]}, False),
    ({"config.json": "{not json"}, False),
    ({}, False),
])
def test_is_blockscale_export(tmp_path, files, ours):
    for name, obj in files.items():
        (tmp_path / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))
    assert is_blockscale_export(tmp_path) is ours
    assert is_blockscale_export(tmp_path / "missing") is False


def test_is_blockscale_export_ignores_symlinked_metadata(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "blockscale_report.json").write_text(json.dumps({"producer": {"name": "blockscale"}}))
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(real / "blockscale_report.json", d / "blockscale_report.json")
    assert is_blockscale_export(real) and not is_blockscale_export(d)


# ---- never the model being read -----------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "contains", "same-via-symlink", "in-list"])
def test_source_is_never_replaced(tmp_path, tiny, where):
    src = export_checkpoint(tiny, tmp_path / "models" / "src", CT)  # a blockscale checkpoint: overwritable
    out = {"same": src, "inside": src / "nvfp4", "contains": tmp_path / "models", "in-list": src,
           "same-via-symlink": tmp_path / "alias"}[where]
    if where == "same-via-symlink":
        os.symlink(src, out)
    source = [tmp_path / "other", str(src)] if where == "in-list" else src
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=rf"out_dir {re.escape(str(out))} .*{re.escape(str(src))}, the model being read"):
        export_checkpoint(tiny, out, MO, overwrite=True, source=source)
    assert _tree(tmp_path) == before


def test_source_elsewhere_is_fine(tmp_path, tiny):
    src = tmp_path / "src"
    src.mkdir()
    out = export_checkpoint(tiny, tmp_path / "src2", CT, source=src)  # a name prefix is not containment
    assert is_blockscale_export(out)
    export_checkpoint(tiny, tmp_path / "x", CT, source="HuggingFaceTB/SmolLM2-135M")  # a hub id, not a path
    with pytest.raises(TypeError, match="source="):
        export_checkpoint(tiny, tmp_path / "y", CT, source=3)


# ---- stale temporary directories -----------------------------------------------------------------
def test_stale_temporaries_of_our_naming_are_removed(tmp_path, tiny):
    host, dead, alive = destination.host_tag(), _dead_pid(), os.getppid()
    hx = "0123abcd"

    def mk(name, files=("model.safetensors",)):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_text("partial")
        return d

    stale = [mk(f".ck.tmp-{host}-{dead}-{hx}"), mk(f".ck.old-{host}-{dead}-{hx}", ("config.json",)),
             mk(f".ck.tmp-{host}-{dead}-ffff0000", ())]
    kept = [mk(f".ck.tmp-{host}-{alive}-{hx}"),                    # its writer is still running
            mk(f".ck.tmp-{'f' * 8 if host != 'f' * 8 else 'e' * 8}-{dead}-{hx}"),  # another machine's
            mk(f".ck.tmp-{hx}"),                                   # older naming: cannot tell
            mk(f".ck2.tmp-{host}-{dead}-{hx}"),                    # another export's
            mk(f".ck.tmp-{host}-{dead}-{hx}x"), mk(f"ck.tmp-{host}-{dead}-{hx}"),
            mk(f".ck.old-{host}-{dead}-ffff0001", ("notes.txt",))]  # holds something we never write
    (tmp_path / f".ck.tmp-{host}-{dead}-ffff0002").write_text("a file, not a directory")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / f".ck.tmp-{host}-{dead}-ffff0003")
    export_checkpoint(tiny, tmp_path / "ck", CT)
    assert not any(d.exists() for d in stale)
    assert all(d.is_dir() and any(d.iterdir()) for d in kept)
    assert (tmp_path / f".ck.tmp-{host}-{dead}-ffff0002").is_file()
    assert (tmp_path / "target" / "keep").exists() and (tmp_path / f".ck.tmp-{host}-{dead}-ffff0003").is_symlink()


def test_temporary_names_identify_their_writer(tmp_path, tiny, monkeypatch):
    seen = []
    real = destination.finish_files

    def spy(directory):
        seen.append(directory.name)
        real(directory)

    monkeypatch.setattr(destination, "finish_files", spy)
    export_checkpoint(tiny, tmp_path / "ck", CT)
    assert len(seen) == 1
    assert destination.parse_temp_name(seen[0], "ck") == ("tmp", destination.host_tag(), os.getpid())
    assert destination.parse_temp_name(seen[0], "c") is None


# ---- run files inside the atomic directory -------------------------------------------------------
def test_extra_files_are_written_inside_the_atomic_directory(tmp_path, tiny, monkeypatch):
    report = {"layers": {"model.layers.0.self_attn.q_proj": {"mse": 0.25}}, "seconds": 1.5}
    out = export_checkpoint(tiny, tmp_path / "ck", CT, extra_files={"ptq_report.json": report})
    assert json.loads((out / "ptq_report.json").read_text()) == report
    rep = json.loads((out / "blockscale_report.json").read_text())
    assert "ptq_report.json" in rep["written_files"] and "blockscale_report.json" in rep["written_files"]
    # a failure at the final rename leaves the previous checkpoint as it was, with no new run file
    before = _tree(tmp_path)
    real_rename = os.rename

    def failing(a, b):
        if Path(a).name.startswith(".ck.tmp-"):
            raise OSError("rename failed (injected)")
        real_rename(a, b)

    monkeypatch.setattr(destination.os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        export_checkpoint(tiny, out, CT, overwrite=True, extra_files={"ptq_report.json": {"new": True}})
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("extra,err,match", [
    ({"../x.json": {}}, ValueError, "plain file name"),
    ({"sub/x.json": {}}, ValueError, "plain file name"),
    ({".x.json": {}}, ValueError, "plain file name"),
    ({"x.txt": {}}, ValueError, r"\.json"),
    ({"config.json": {}}, ValueError, "written by the export"),
    ({"blockscale_report.json": {}}, ValueError, "written by the export"),
    ({"tokenizer_config.json": {}}, ValueError, "written by the export"),
    ({"model.safetensors.index.json": {}}, ValueError, "written by the export"),
    ({3: {}}, TypeError, "extra_files"),
    ([("a.json", {})], TypeError, "extra_files"),
    ({"a.json": {"t": torch.zeros(1)}}, TypeError, "a.json.*JSON-serializable"),
    ({"a.json": {"ppl": float("nan")}}, TypeError, "a.json.*JSON-serializable"),
])
def test_extra_files_errors(tmp_path, tiny, extra, err, match):
    with pytest.raises(err, match=match):
        export_checkpoint(tiny, tmp_path / "ck", CT, extra_files=extra)
    assert os.listdir(tmp_path) == []


# ---- file modes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
@pytest.mark.parametrize("fmt,shard", [(CT, "2GB"), (MO, "8KB")])
def test_every_file_gets_the_same_mode(tmp_path, tiny, umask, mode, fmt, shard):
    old = os.umask(umask)
    try:
        out = export_checkpoint(tiny, tmp_path / "ck", fmt, max_shard_size=shard,
                                extra_files={"ptq_report.json": {"a": 1}})
    finally:
        os.umask(old)
    files = sorted(out.iterdir())
    assert any(f.name.endswith(".safetensors") for f in files) and len(files) >= 5
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}


# ---- honest export: what stays in high precision ------------------------------------------------
def make_mixtral(dtype=torch.float32, layers=2, tied=False):
    """A tiny transformers >= 5 Mixtral (fused 3-D experts) whose attention Linears are NVFP4Linear
    (one encode scale per q/k/v group, as make_model does); experts, routers and lm_head stay dense."""
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    spec = bs.NVFP4()
    lins = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in n}
    for group in fused_groups(list(lins)):
        S = outer_scale(torch.stack([lins[n].weight.detach().float().abs().max() for n in group]).max(),
                        spec.outer_bound)
        for n in group:
            q = bs.quantize(lins[n].weight.detach(), spec, encode_scale=S)
            replace_module(model, n, NVFP4Linear.from_quantized(q, None, dtype=dtype))
    return model


# per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 quantized; router 4x64, experts 4x64x64 + 4x64x32 dense
Q_LAYER, ROUTER, EXPERTS, HEAD = 12288, 256, 4 * 64 * 64 + 4 * 64 * 32, VOCAB * 64


@pytest.mark.parametrize("fmt", [CT, MO])
def test_moe_experts_and_routers_are_listed_as_high_precision(tmp_path, fmt):
    model = make_mixtral()
    ref = model_logits(model)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    # hub names (Mixtral's .mlp. is .block_sparse_moe. on the hub): the router, the experts module, each
    # high-precision per-expert Linear as save_pretrained writes it, and the names vLLM's compressed-tensors MoE
    # method probes (<experts>.0.gate_proj / up_proj / down_proj) so that it keeps the experts unquantized
    modules, listed = [], []
    for i in range(2):
        m = f"model.layers.{i}.block_sparse_moe"
        modules += [f"{m}.gate", f"{m}.experts"]
        listed += [f"{m}.gate", f"{m}.experts"]
        listed += [f"{m}.experts.{e}.{leaf}" for e in range(4) for leaf in ("w1", "w3", "w2")]
        listed += [f"{m}.experts.0.{leaf}" for leaf in ("gate_proj", "up_proj", "down_proj")]
    listed.append("lm_head")
    modules.append("lm_head")
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["ignore"] == listed
    if fmt == MO:
        hq = json.loads((out / "hf_quant_config.json").read_text())
        assert hq["quantization"]["exclude_modules"] == listed
    high = 2 * (ROUTER + EXPERTS) + 2 * HEAD  # embed_tokens + lm_head (untied)
    frac = high / (2 * Q_LAYER + high)
    assert q["blockscale"]["high_precision_fraction"] == pytest.approx(frac, rel=1e-12) and frac > 0.7
    rep = json.loads((out / "blockscale_report.json").read_text())
    hp = rep["high_precision_modules"]
    assert sorted(hp) == sorted(["model.embed_tokens"] + modules)  # the report is written with sorted keys
    assert hp["model.layers.1.block_sparse_moe.experts"] == {
        "type": "MixtralExperts", "elements": EXPERTS,
        "parameters": {"gate_up_proj": [4, 64, 64], "down_proj": [4, 64, 32]}}
    assert hp["model.layers.0.block_sparse_moe.gate"]["elements"] == ROUTER and hp["lm_head"]["type"] == "Linear"
    assert rep["weight_elements"] == {"quantized": 2 * Q_LAYER, "high_precision": high,
                                      "high_precision_fraction": q["blockscale"]["high_precision_fraction"]}
    assert rep["high_precision_linears"] == ["lm_head"] + [
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{leaf}" for i in range(2) for e in range(4)
        for leaf in ("w1", "w3", "w2")]
    loaded = bs.load(out)
    assert sum(isinstance(m, NVFP4Linear) for m in loaded.modules()) == 8
    assert torch.equal(model_logits(loaded), ref)


def test_tied_weights_are_counted_once(tmp_path):
    model = make_model(tied=True)  # 2 Llama layers, every decoder Linear NVFP4; lm_head tied to embed_tokens
    out = export_checkpoint(model, tmp_path / "ck", CT)
    rep = json.loads((out / "blockscale_report.json").read_text())
    quantized = 2 * (2 * 4096 + 2 * 2048 + 3 * 96 * 64)
    assert rep["weight_elements"] == {"quantized": quantized, "high_precision": HEAD,
                                      "high_precision_fraction": HEAD / (quantized + HEAD)}
    assert rep["high_precision_modules"]["lm_head"] == {"type": "Linear", "elements": HEAD,
                                                        "parameters": {"weight": [VOCAB, 64]},
                                                        "tied_to": "model.embed_tokens"}
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head"] and q["blockscale"]["high_precision_fraction"] == HEAD / (quantized + HEAD)
