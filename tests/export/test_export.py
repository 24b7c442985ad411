"""NVFP4 checkpoint export (compressed-tensors nvfp4-pack-quantized, ModelOpt modelopt_fp4) and load:
exact tensor names / dtypes / shapes and configs, fused groups share outer scales, reloaded logits
equal the in-memory model's bit for bit, both formats store the same bytes, sharding, atomic
writes. (Errors on bad arguments and damaged checkpoints: test_export_errors.py.)"""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import blockscale as bs
from blockscale.export import checkpoint_format, export_checkpoint, load_checkpoint
from blockscale.export import writer
from blockscale.quant.nvfp4 import reciprocal_fixed_point
from blockscale.quant.nvfp4 import outer_scale

transformers = pytest.importorskip("transformers")
from nvfp4_checkpoints import CT, MO, VOCAB, make_model, model_logits, nvfp4_linears  # noqa: E402
from tiny_models import checkpoint_tensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


# ---- the key property -----------------------------------------------------------------------------
VARIANTS = {
    "fp32-bias-tied": dict(dtype=torch.float32, bias=True, tied=True),
    "bf16-untied": dict(dtype=torch.bfloat16, bias=False, tied=False),
    "bf16-bias-4over6w": dict(dtype=torch.bfloat16, bias=True, tied=True, weight_rule="4over6"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("act", [None, "6", "4over6", "mixed"])
@pytest.mark.parametrize("fmt", [CT, MO])
def test_reload_logits_bit_exact(tmp_path, fmt, act, variant):
    model = make_model(act=act, **VARIANTS[variant])
    ref = model_logits(model)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    assert checkpoint_format(out) == fmt
    loaded = load_checkpoint(out)
    assert not loaded.training
    assert ref.dtype == VARIANTS[variant]["dtype"] and model_logits(loaded).dtype == ref.dtype
    assert torch.equal(model_logits(loaded), ref)
    q0, q1 = nvfp4_linears(model), nvfp4_linears(loaded)
    assert list(q0) == list(q1)
    for n, m in q0.items():
        l = q1[n]
        assert (l.input_scale_rule, l.bias is None) == (m.input_scale_rule, m.bias is None)
        if act is not None:
            assert l.input_error == m.input_error
            assert torch.equal(l.input_global_scale, m.input_global_scale)
        assert torch.equal(l.dequantized_weight(torch.float32), m.dequantized_weight(torch.float32))
        assert torch.equal(l.weight_packed, m.weight_packed)
        assert torch.equal(l.weight_scale.view(torch.uint8), m.weight_scale.view(torch.uint8))
        if fmt == CT:
            assert torch.equal(l.weight_global_scale, m.weight_global_scale)
    if VARIANTS[variant]["tied"]:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_reload_then_reexport_is_identical(tmp_path):
    model = make_model(act="6", bias=True)
    a = export_checkpoint(model, tmp_path / "a", MO)
    b = export_checkpoint(load_checkpoint(a), tmp_path / "b", MO)
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys()
    assert all(ta[k].dtype == tb[k].dtype and torch.equal(_bytes(ta[k]), _bytes(tb[k])) for k in ta)
    c = export_checkpoint(load_checkpoint(a), tmp_path / "c", CT)
    d = export_checkpoint(model, tmp_path / "d", CT)
    tc, td = checkpoint_tensors(c), checkpoint_tensors(d)
    assert tc.keys() == td.keys()
    for k in td:  # ModelOpt stores fl(1/S): S itself comes back as some S' with fl(1/S') == fl(1/S)
        if k.endswith(".weight_global_scale"):
            assert torch.equal(1.0 / tc[k], 1.0 / td[k])
        else:
            assert torch.equal(_bytes(tc[k]), _bytes(td[k])), k


# ---- exact tensor names / dtypes / shapes ---------------------------------------------------------
def _expected_layout(model, fmt, w4a4):
    exp = {"model.embed_tokens.weight": (model.dtype, (VOCAB, 64)), "model.norm.weight": (model.dtype, (64,))}
    if not model.config.tie_word_embeddings:
        exp["lm_head.weight"] = (model.dtype, (VOCAB, 64))
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        exp[p + "input_layernorm.weight"] = (model.dtype, (64,))
        exp[p + "post_attention_layernorm.weight"] = (model.dtype, (64,))
    for n, m in nvfp4_linears(model).items():
        N, K = m.out_features, m.in_features
        if fmt == CT:
            exp[n + ".weight_packed"] = (torch.uint8, (N, K // 2))
            exp[n + ".weight_scale"] = (torch.float8_e4m3fn, (N, K // 16))
            exp[n + ".weight_global_scale"] = (torch.float32, (1,))
            if w4a4:
                exp[n + ".input_global_scale"] = (torch.float32, (1,))
        else:
            exp[n + ".weight"] = (torch.uint8, (N, K // 2))
            exp[n + ".weight_scale"] = (torch.float8_e4m3fn, (N, K // 16))
            exp[n + ".weight_scale_2"] = (torch.float32, ())
            if w4a4:
                exp[n + ".input_scale"] = (torch.float32, ())
        if m.bias is not None:
            exp[n + ".bias"] = (model.dtype, (N,))
    return exp


@pytest.mark.parametrize("fmt", [CT, MO])
@pytest.mark.parametrize("act,dtype,tied,bias", [(None, torch.bfloat16, True, False), ("6", torch.float32, False, True)])
def test_tensor_names_dtypes_shapes(tmp_path, fmt, act, dtype, tied, bias):
    model = make_model(dtype, act=act, tied=tied, bias=bias)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert ("hf_quant_config.json" in files) == (fmt == MO)
    assert {"config.json", "generation_config.json", "blockscale_report.json"} <= set(files)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()  # + the SHA-256 of every tensor and of config.json (test_checkpoint_integrity.py)
        assert set(meta) == {"format", "blockscale.sha256", "blockscale.config_sha256"} and meta["format"] == "pt"
        got = {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()}
    assert got == _expected_layout(model, fmt, act is not None)
    assert len(nvfp4_linears(model)) == 14


def test_both_formats_store_the_same_bytes(tmp_path):
    model = make_model(act="4over6", bias=True)
    ct = checkpoint_tensors(export_checkpoint(model, tmp_path / "ct", CT))
    mo = checkpoint_tensors(export_checkpoint(model, tmp_path / "mo", MO))
    for n, m in nvfp4_linears(model).items():
        assert torch.equal(ct[n + ".weight_packed"], mo[n + ".weight"])
        assert torch.equal(ct[n + ".weight_packed"], m.weight_packed)
        assert torch.equal(ct[n + ".weight_scale"].view(torch.uint8), mo[n + ".weight_scale"].view(torch.uint8))
        assert torch.equal(ct[n + ".weight_global_scale"], m.weight_global_scale)
        S, S_in = m.weight_global_scale.reshape(()), m.input_global_scale.reshape(())
        assert torch.equal(mo[n + ".weight_scale_2"], 1.0 / S)          # ModelOpt: amax/2688 = fl(1/S)
        assert torch.equal(mo[n + ".input_scale"], 1.0 / S_in)
        assert torch.equal(ct[n + ".input_global_scale"].reshape(()), S_in)
    plain = [k for k in ct if not any(k.startswith(n + ".") and not k.endswith(".bias") for n in nvfp4_linears(model))]
    for k in plain:
        assert torch.equal(ct[k], mo[k])


def test_four_over_six_weights_store_their_actual_scale(tmp_path):
    model = make_model(weight_rule="4over6")
    ct = checkpoint_tensors(export_checkpoint(model, tmp_path / "ct", CT))
    for n, amax in model.test_group_amax.items():
        S = ct[n + ".weight_global_scale"]
        assert torch.equal(S, outer_scale(amax, 256.0).reshape(1))  # 1536 / amax, not 2688 / amax
        assert not torch.equal(S, outer_scale(amax, 448.0).reshape(1))


# ---- configs --------------------------------------------------------------------------------------
NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "scale_dtype": "torch.float8_e4m3fn"}


@pytest.mark.parametrize("act", [None, "4over6"])
def test_compressed_tensors_config(tmp_path, act):
    model = make_model(torch.bfloat16, act=act, tied=False, keep=("model.layers.1.mlp.down_proj",))
    out = export_checkpoint(model, tmp_path / "ck", CT, metadata={"method": "gptq", "calibration": {"samples": 8}})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    q = cfg["quantization_config"]
    bsm = q.pop("blockscale")
    acts = None if act is None else {**NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"}
    assert q == {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**NVFP4_ARGS, "dynamic": False},
                                      "input_activations": acts, "output_activations": None,
                                      "format": "nvfp4-pack-quantized"}},
        "format": "nvfp4-pack-quantized", "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "ignore": ["model.layers.1.mlp.down_proj", "lm_head"], "kv_cache_scheme": None,
        "global_compression_ratio": None, "moe_sparsity_config": None, "sparsity_config": {},
        "transform_config": {}, "version": "0.20.1"}
    assert bsm["version"] == bs.__version__ and bsm["format"] == CT and bsm["method"] == "gptq"
    assert bsm["metadata"] == {"method": "gptq", "calibration": {"samples": 8}}
    assert bsm["scheme"] == ("NVFP4A16" if act is None else "NVFP4")
    if act:
        assert bsm["input_scale_rule"] == "4over6" and bsm["input_error"] == "mse" and "input_overrides" not in bsm
    rep = json.loads((out / "blockscale_report.json").read_text())
    assert rep["producer"] == {"name": "blockscale", "version": bs.__version__}
    assert rep["high_precision_linears"] == ["model.layers.1.mlp.down_proj", "lm_head"]
    assert len(rep["quantized_modules"]) == 13 and rep["files"] == ["model.safetensors"]
    assert ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"] in rep["fused_groups"]
    # the high-precision Linear stays an nn.Linear on reload, and everything matches
    loaded = load_checkpoint(out)
    assert type(loaded.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert torch.equal(model_logits(loaded), model_logits(model))
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == 1


@pytest.mark.parametrize("act", [None, "6"])
def test_modelopt_config(tmp_path, act):
    model = make_model(act=act)
    out = export_checkpoint(model, tmp_path / "ck", MO)
    algo = "W4A16_NVFP4" if act is None else "NVFP4"
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq == {"producer": {"name": "blockscale", "version": bs.__version__},
                  "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head"]}}
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["blockscale"]["format"] == MO
    del q["blockscale"]
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": args, "targets": ["Linear"], **({"input_activations": args} if act else {})}
    assert q == {"config_groups": {"group_0": group}, "ignore": ["lm_head"], "quant_algo": algo, "group_size": 16,
                 "producer": hq["producer"], "quant_method": "modelopt"}


def test_tokenizer_files_written(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    out = export_checkpoint(make_model(layers=1), tmp_path / "ck", CT, tokenizer=fast)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(str(out))("a b").input_ids == [1, 2]


# ---- fused groups ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [CT, MO])
def test_fused_groups_share_outer_scales(tmp_path, fmt):
    model = make_model(act="6")
    t = checkpoint_tensors(export_checkpoint(model, tmp_path / "ck", fmt))
    suffix = ".weight_global_scale" if fmt == CT else ".weight_scale_2"
    for i in range(2):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            vals = [t[f"model.layers.{i}.{n}{suffix}"] for n in group]
            assert all(torch.equal(v, vals[0]) for v in vals)
    # non-fused modules get their own scale
    assert not torch.equal(t["model.layers.0.self_attn.o_proj" + suffix], t["model.layers.0.self_attn.q_proj" + suffix])


@pytest.mark.parametrize("fmt", [CT, MO])
def test_unshared_fused_scales_rejected_on_export(tmp_path, fmt):
    model = make_model(unshared=True)
    with pytest.raises(ValueError, match=r"fused modules \['model\.layers\.0\.self_attn\.q_proj', "
                                         r"'model\.layers\.0\.self_attn\.k_proj', 'model\.layers\.0\.self_attn\.v_proj'\] "
                                         r"have different weight_global_scale.*q_proj=\d"):
        export_checkpoint(model, tmp_path / "ck", fmt)
    assert not (tmp_path / "ck").exists() and os.listdir(tmp_path) == []


def test_unshared_input_scales_and_partial_groups_rejected(tmp_path):
    model = make_model(act="6")
    k = model.model.layers[1].self_attn.k_proj
    k.input_global_scale.copy_(reciprocal_fixed_point(k.input_global_scale * 2))
    with pytest.raises(ValueError, match=r"different input_global_scale.*layers\.1\.self_attn\.k_proj"):
        export_checkpoint(model, tmp_path / "ck", CT)
    model = make_model(keep=("model.layers.0.mlp.up_proj",))
    with pytest.raises(ValueError, match=r"gate_proj'\] are NVFP4 but \['model\.layers\.0\.mlp\.up_proj'\] are high"):
        export_checkpoint(model, tmp_path / "ck", MO)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_unshared_fused_scales_rejected_on_load(tmp_path, fmt):
    out = export_checkpoint(make_model(), tmp_path / "ck", fmt)
    path = out / "model.safetensors"
    t = load_file(str(path))
    key = "model.layers.1.mlp.up_proj." + ("weight_global_scale" if fmt == CT else "weight_scale_2")
    t[key] = t[key] * 2
    save_file(t, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"fused modules \['model\.layers\.1\.mlp\.gate_proj', "
                                         r"'model\.layers\.1\.mlp\.up_proj'\] have different"):
        load_checkpoint(out)


# ---- sharding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [CT, MO])
def test_sharded_export(tmp_path, fmt):
    model = make_model(torch.bfloat16, act="6", bias=True, tied=False)
    out = export_checkpoint(model, tmp_path / "ck", fmt, max_shard_size="12KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = checkpoint_tensors(out)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in shards:
        with safe_open(str(out / name), "pt") as f:
            assert all(index["weight_map"][k] == name for k in f.keys())
            assert sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()) <= 12000 or \
                len(list(f.keys())) == 1
    assert json.loads((out / "blockscale_report.json").read_text())["files"] == shards
    assert torch.equal(model_logits(load_checkpoint(out)), model_logits(model))


def test_parse_size():
    assert writer.parse_size("2GB") == 2 * 10**9 and writer.parse_size("1GiB") == 2**30
    assert writer.parse_size("1.5MB") == 1_500_000 and writer.parse_size(4096) == 4096
    for bad in ("", "2 parsecs", -1, 0, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            writer.parse_size(bad)


# ---- atomicity ------------------------------------------------------------------------------------
def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def failing(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        save_file(tensors, str(path), metadata=metadata)

    monkeypatch.setattr(writer, "write_shard", failing)
    with pytest.raises(OSError, match="injected"):
        export_checkpoint(make_model(), tmp_path / "ck", CT, max_shard_size="16KB")
    assert len(calls) == 2 and calls[0].parent.name.startswith(".ck.tmp-")
    assert os.listdir(tmp_path) == []


def test_existing_directory(tmp_path):
    model = make_model(layers=1)
    out = tmp_path / "ck"
    out.mkdir()
    assert export_checkpoint(model, out, CT) == out  # an empty directory is fine
    (out / "ptq_report.json").write_text("{}")  # a run report of ours
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        export_checkpoint(model, out, MO)
    assert checkpoint_format(out) == CT and (out / "ptq_report.json").exists()
    export_checkpoint(model, out, MO, overwrite=True)
    assert checkpoint_format(out) == MO and not (out / "ptq_report.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp / old directories left behind
    (out / "stale.txt").write_text("old")  # not ours: never deleted (tests/export/test_export_safety.py)
    with pytest.raises(FileExistsError, match=r"does not write \(stale.txt\)"):
        export_checkpoint(model, out, CT, overwrite=True)
    assert checkpoint_format(out) == MO and (out / "stale.txt").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_checkpoint(model, tmp_path / "file", CT, overwrite=True)
