"""R3 key rotations in checkpoints (issue 33): compressed-tensors ``transform_config`` group ``R3`` with
``q_attn`` + ``k_cache`` on the attention modules (llm-compressor's SpinQuant template), parsed by
compressed-tensors' own ``TransformConfig``; the matrix once as ``<attn>.R3_q_attn.weight``; bit-exact reload with
the FP8 KV scales; ModelOpt refused; the loader's refusals of half an R3 group."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.export.common import CheckpointError
from blockscale.nn.input_rotation import input_rotations
from blockscale.nn.kv_cache import key_rotations, kv_scales
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.recipes import KVCacheScheme, get_ptq_recipe

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 12, seed=4)
CALIB = token_ids(8, 32, seed=0)
ATTNS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def _rotated(rotate: str = "r3"):
    model = tiny_hf_llama()
    recipe = get_ptq_recipe("nvfp4-experts-fp8-attention").replace(kv_cache=KVCacheScheme())
    quantize_model(model, PTQConfig(recipe=recipe, rotate=rotate, batch_size=8), CALIB, progress=False)
    return model


def _logits(model):
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def _config(out):
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("rotate", ["r3", "r1r2r3r4"])
def test_r3_round_trip(tmp_path, rotate):
    from compressed_tensors.transform import TransformConfig

    model = _rotated(rotate)
    out = export_checkpoint(model, tmp_path / "ck")
    tc = TransformConfig.model_validate(_config(out)["quantization_config"]["transform_config"])
    r3 = tc.config_groups["R3"]
    assert r3.type == "hadamard" and r3.head_dim == 16
    assert {(a.location, a.inverse): a.targets for a in r3.apply} == {("q_attn", False): ATTNS,
                                                                      ("k_cache", False): ATTNS}
    stored = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if "R3_" in k}
    assert list(stored) == ["model.layers.0.self_attn.R3_q_attn.weight"]
    assert torch.equal(stored[ATTNS[0] + ".R3_q_attn.weight"].double(), key_rotations(model)[ATTNS[0]][1].signed)
    back = load_checkpoint(out)
    assert {n: (g, r.size) for n, (g, r) in key_rotations(back).items()} == {n: ("R3", 16) for n in ATTNS}
    assert len(input_rotations(back)) == len(input_rotations(model))
    for name in ATTNS:
        assert all(torch.equal(a, b) for a, b in zip(kv_scales(back.get_submodule(name)),
                                                     kv_scales(model.get_submodule(name))))
    assert torch.equal(_logits(back), _logits(model))


def test_modelopt_refuses_key_rotations(tmp_path):
    with pytest.raises(ValueError, match="modelopt checkpoints cannot hold online rotations .*self_attn has a key "
                                         "rotation \\(R3\\)"):
        export_checkpoint(_rotated(), tmp_path / "mo", "modelopt")
    assert not (tmp_path / "mo").exists()


def test_matrix_under_the_k_cache_name_loads(tmp_path):
    """compressed-tensors ties q_attn and k_cache to one matrix; either name may be the one saved."""
    model = _rotated()
    out = export_checkpoint(model, tmp_path / "ck")
    f = out / "model.safetensors"
    t = load_file(str(f))
    t[ATTNS[0] + ".R3_k_cache.weight"] = t.pop(ATTNS[0] + ".R3_q_attn.weight")
    save_file(t, str(f), metadata={"format": "pt"})
    assert torch.equal(_logits(load_checkpoint(out, verify=False)), _logits(model))


@pytest.mark.parametrize("change, match", [
    (lambda s: s["apply"].pop(1), "q_attn without k_cache: queries and keys must be rotated together"),
    (lambda s: s["apply"][1].__setitem__("targets", ATTNS[:1]), "different targets"),
    (lambda s: s["apply"][0].__setitem__("inverse", True), "inverse q_attn transform is not supported"),
    (lambda s: s["apply"].append({"targets": ["Linear"], "location": "input"}), "cannot also hold input"),
    (lambda s: s.__setitem__("head_dim", 32), "head_dim 16 is not a multiple of transform group 'R3'"),
])
def test_loader_refuses_bad_r3_groups(tmp_path, change, match):
    out = export_checkpoint(_rotated(), tmp_path / "ck")
    cfg = _config(out)
    change(cfg["quantization_config"]["transform_config"]["config_groups"]["R3"])
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(out, verify=False)


def test_class_name_targets_match_attention_modules(tmp_path):
    """A producer naming the attention class (compressed-tensors matches class names too) loads the same."""
    model = _rotated()
    out = export_checkpoint(model, tmp_path / "ck")
    cfg = _config(out)
    for a in cfg["quantization_config"]["transform_config"]["config_groups"]["R3"]["apply"]:
        a["targets"] = ["LlamaAttention"]
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_checkpoint(out, verify=False)
    assert set(key_rotations(back)) == set(ATTNS) and torch.equal(_logits(back), _logits(model))


def _ct_applied():
    """(fp logits, our R3 key rotations, the model compressed-tensors' ``apply_transform_config`` hooked with the
    config we write, the matrices we write)."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    from blockscale.export.ct_transforms import transform_config
    from blockscale.ptq.rotations import parse_rotate, rotate_model

    ours = tiny_hf_llama()
    ref = _logits(ours)
    rotate_model(ours, parse_rotate("r3"))
    keys = key_rotations(ours)
    cfg, tensors = transform_config({}, torch.float32, keys)
    theirs = tiny_hf_llama()
    apply_transform_config(theirs, TransformConfig.model_validate(cfg))
    return ref, keys, theirs, tensors


def test_compressed_tensors_applies_our_r3_group():
    """compressed-tensors' own ``apply_transform_config`` of the R3 group we write hooks every attention module's
    queries and keys with our ±1 matrix (``<attn>.R3_q_attn`` / ``R3_k_cache``)."""
    _, keys, theirs, tensors = _ct_applied()
    for name, (group, rot) in keys.items():
        for loc in ("q_attn", "k_cache"):
            assert torch.equal(theirs.get_submodule(f"{name}.{group}_{loc}").weight.double(), rot.signed), name
    assert list(tensors) == [ATTNS[0] + ".R3_q_attn.weight"]


@pytest.mark.xfail(reason="compressed-tensors 0.20.1 hooks the key cache through the attention kwarg "
                          "past_key_values / past_key_value, which transformers 5.x renamed `cache`: its k_cache "
                          "transform never runs, so only the queries are rotated", strict=False)
def test_compressed_tensors_r3_keeps_q_k_product():
    ref, _, theirs, _ = _ct_applied()
    with torch.no_grad():
        got = theirs(IDS, use_cache=True).logits
    assert (got - ref).abs().max() < 1e-5
