"""Export and load errors: bad export arguments (unknown format, non-JSON metadata, no NVFP4Linear,
a ModelOpt input scale that is no reciprocal fixed point), damaged checkpoints
(truncated or corrupt shards, missing / unexpected / mistyped tensors, inconsistent index and configs),
the load dtype cast, and ModelOpt's S from fl(1/S). Split from test_export.py."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockscale.export import CheckpointError, checkpoint_format, export_checkpoint, load_checkpoint
from blockscale.export.modelopt import encode_scale_from_decode
from blockscale.nn import NVFP4Linear

from nvfp4_checkpoints import CT, MO, make_model, model_logits, nvfp4_linears, replace_module  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


# ---- errors ---------------------------------------------------------------------------------------
def test_export_argument_errors(tmp_path):
    model = make_model(layers=1)
    with pytest.raises(ValueError, match="format='gguf'"):
        export_checkpoint(model, tmp_path / "a", "gguf")
    with pytest.raises(TypeError, match="JSON-serializable"):
        export_checkpoint(model, tmp_path / "a", CT, metadata={"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        export_checkpoint(transformers.AutoModelForCausalLM.from_config(model.config), tmp_path / "a")
    mixed = make_model(layers=1, act="6")
    m = mixed.model.layers[0].self_attn.o_proj
    replace_module(mixed, "model.layers.0.self_attn.o_proj", NVFP4Linear.from_quantized(m.quantized_weight()))
    # W4A4 and W4A16 NVFP4 Linears together: two schemes (issue 15), written in the mixed form, exact
    for fmt in (CT, MO):
        out = export_checkpoint(mixed, tmp_path / f"mixed-{fmt}", fmt)
        qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
        assert len(qcfg["config_groups"]) == 2
        assert torch.equal(model_logits(load_checkpoint(out)), model_logits(mixed))
    bad = make_model(layers=1, act="6")
    s = torch.tensor([448.0])
    while torch.equal(1.0 / (1.0 / s), s):
        s = torch.nextafter(s, torch.tensor([1e9]))
    for n, m in nvfp4_linears(bad).items():
        m.input_global_scale.copy_(s)
    with pytest.raises(ValueError, match="input_global_scale=.* is not a reciprocal fixed point"):
        export_checkpoint(bad, tmp_path / "a", MO)
    assert torch.equal(model_logits(load_checkpoint(export_checkpoint(bad, tmp_path / "b", CT))), model_logits(bad))
    assert not (tmp_path / "a").exists()


def _rewrite(path: Path, fn):
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("exported")
    model = make_model(layers=1, act="6")
    return {fmt: export_checkpoint(model, root / fmt, fmt) for fmt in (CT, MO)}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("fmt", [CT, MO])
def test_truncated_or_corrupt_file(tmp_path, exported, fmt):
    out = _copy(exported[fmt], tmp_path / "ck")
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupt"):
        load_checkpoint(out)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_checkpoint(out)
    f.write_bytes(data[:8] + b"\x00" * (len(data) - 8))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        load_checkpoint(out)
    f.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_checkpoint(out)
    f.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(out)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_missing_unexpected_and_mistyped_tensors(tmp_path, exported, fmt):
    packed = "weight_packed" if fmt == CT else "weight"
    q = "model.layers.0.self_attn.o_proj."
    cases = [
        (lambda t: t.pop(q + "weight_scale"), rf"missing: {q}weight_scale"),
        (lambda t: t.__setitem__("model.extra", torch.zeros(2)), r"unexpected: model\.extra"),
        (lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()),
         r"unexpected: lm_head\.weight"),
        (lambda t: t.__setitem__(q + "weight_scale", t[q + "weight_scale"].view(torch.uint8)),
         rf"tensor '{q}weight_scale': torch\.uint8 \[64, 4\], expected torch\.float8_e4m3fn \[64, 4\]"),
        (lambda t: t.__setitem__(q + packed, t[q + packed][:, :16].contiguous()),
         rf"tensor '{q}{packed}': torch\.uint8 \[64, 16\], expected torch\.uint8 \[64, 32\]"),
        (lambda t: t.__setitem__("model.norm.weight", torch.ones(63)), r"'model\.norm\.weight': shape \[63\]"),
        (lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.float16)),
         r"'model\.norm\.weight': torch\.float16, expected torch\.float32"),
    ]
    for i, (edit, msg) in enumerate(cases):
        out = _copy(exported[fmt], tmp_path / f"ck{i}")
        _rewrite(out / "model.safetensors", edit)
        with pytest.raises(CheckpointError, match=msg):
            load_checkpoint(out)


def test_inconsistent_index_and_configs(tmp_path, exported):
    out = _copy(exported[CT], tmp_path / "ck")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="group_size.*is not NVFP4"):
        load_checkpoint(out)
    cfg["quantization_config"]["quant_method"] = "awq"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not an NVFP4 checkpoint"):
        checkpoint_format(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_checkpoint(out)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")

    out = _copy(exported[MO], tmp_path / "mo")
    hq = json.loads((out / "hf_quant_config.json").read_text())
    hq["quantization"]["quant_algo"] = "FP8"
    (out / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match="quant_algo 'FP8' is not supported"):
        load_checkpoint(out)

    out = export_checkpoint(make_model(layers=1), tmp_path / "sh", CT, max_shard_size="8KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    counts = {f: list(index["weight_map"].values()).count(f) for f in index["weight_map"].values()}
    first = sorted(k for k, f in index["weight_map"].items() if counts[f] > 1)[0]
    index["weight_map"].pop(first)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"weight_map disagrees.*not listed: \['{first}'\]"):
        load_checkpoint(out)
    last = sorted(out.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{last.name}'.*missing"):
        load_checkpoint(out)


def test_load_dtype_cast(tmp_path, exported):
    m32 = load_checkpoint(exported[MO])
    m16 = load_checkpoint(exported[MO], dtype=torch.bfloat16)
    assert m32.model.norm.weight.dtype == torch.float32 and m16.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(m16.model.norm.weight, m32.model.norm.weight.bfloat16())
    assert m16.model.layers[0].self_attn.q_proj.dequantized_weight().dtype == torch.bfloat16
    assert model_logits(m16).dtype == torch.bfloat16


def test_scale_from_reciprocal_roundtrips():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F7FFFFF, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    S = torch.cat([bits.view(torch.float32), torch.tensor([torch.finfo(torch.float32).max, 1.0, 2688.0])])
    for s in S[::97].tolist() + S[-3:].tolist():
        s = torch.tensor(s, dtype=torch.float32)
        r = 1.0 / s
        rec = encode_scale_from_decode(r)
        assert torch.equal(1.0 / rec, r.reshape(1))
    with pytest.raises(ValueError, match="positive finite"):
        encode_scale_from_decode(torch.tensor(0.0))
