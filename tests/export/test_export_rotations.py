"""Rotated models in checkpoints (issue 33): compressed-tensors ``transform_config`` as compressed-tensors' own
``TransformConfig`` parses it, the ±1 matrices under ``<module>.<group>_input.weight``, what vLLM's transform loader
expects replayed as a table on our export, bit-exact reload in both formats (ModelOpt: fused rotations only; online
ones refused), the loader's refusals of malformed transforms, a shared (deduplicated) matrix as compressed-tensors
writes it, and plain transformers generating the same greedy tokens as ``bs.load`` from a fused-rotation export."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockscale as bs
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.export.common import CheckpointError
from blockscale.nn.input_rotation import input_rotations
from blockscale.ptq import PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 12, seed=4)
CALIB = token_ids(8, 32, seed=0)


def _rotated(rotate: str, acts: str = "w4a4", method: str = "rtn"):
    model = tiny_hf_llama()
    quantize_model(model, PTQConfig(method=method, activations=acts, rotate=rotate), CALIB, progress=False)
    return model


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _config(out):
    return json.loads((out / "config.json").read_text())


def _edit(out, fn):
    """Apply ``fn(tensors)`` to the checkpoint's one safetensors file (and drop the digests: a hand edit)."""
    f = out / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("rotate", ["r1r2r4", "quip", "mr", "r1r2+block:32"])
def test_compressed_tensors_round_trip(tmp_path, rotate):
    from compressed_tensors.transform import TransformConfig

    model = _rotated(rotate)
    out = export_checkpoint(model, tmp_path / "ck")
    cfg = _config(out)["quantization_config"]
    tc = TransformConfig.model_validate(cfg["transform_config"])  # compressed-tensors' own model (extra="forbid")
    rotations = input_rotations(model)
    assert sorted(tc.config_groups) == sorted({g for g, _ in rotations.values()})
    tensors = load_file(str(out / "model.safetensors"))
    stored = {k: v for k, v in tensors.items() if k.endswith("_input.weight")}
    assert len(stored) == len(tc.config_groups)  # one matrix per group, as compressed-tensors saves shared ones
    for name, (group, rot) in rotations.items():
        scheme = tc.config_groups[group]
        assert scheme.type == "hadamard" and scheme.head_dim == rot.size and not scheme.randomize
        locs = {(a.location, a.inverse): set(a.targets) for a in scheme.apply}
        assert name in locs[("input", False)] and name in locs[("weight_input", True)]
        key = f"{sorted(locs[('input', False)])[0]}.{group}_input.weight"
        assert torch.equal(stored[key].double(), rot.signed)  # unnormalised ±1
    back = load_checkpoint(out)
    assert {n: (g, r.size) for n, (g, r) in input_rotations(back).items()} == \
        {n: (g, r.size) for n, (g, r) in rotations.items()}
    assert torch.equal(_logits(back), _logits(model))


def test_vllm_loader_expectations(tmp_path):
    """vLLM's compressed-tensors transform loader (docs/formats.md "Rotations"), as checks on our export."""
    model = _rotated("mr")
    out = export_checkpoint(model, tmp_path / "ck")
    tc = _config(out)["quantization_config"]["transform_config"]["config_groups"]
    tensors = load_file(str(out / "model.safetensors"))
    siblings = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    rows = []
    for group, scheme in tc.items():
        online = [a for a in scheme["apply"] if a["location"] == "input"]
        rows += [
            ("only input / weight_input locations", {a["location"] for a in scheme["apply"]} <= {"input", "weight_input"}),
            ("online transforms are not inverse", all(a["inverse"] is False for a in online)),
            ("no random permutation (perm is not loaded)", scheme["randomize"] is False),
            ("head_dim in QuTLASS's {16, 32, 64, 128}", scheme["head_dim"] in (16, 32, 64, 128)),
            ("hadacore: Sylvester, power of two <= 2^15", scheme["type"] == "hadamard"
             and scheme["head_dim"] & (scheme["head_dim"] - 1) == 0),
        ]
        found = [tensors[f"{t}.{group}_input.weight"] for t in online[0]["targets"]
                 if f"{t}.{group}_input.weight" in tensors]  # vLLM fills every sharer of (group, size) from one key
        rows.append((f"{group}: one stored [{scheme['head_dim']}]^2 ±1 matrix", len(found) == 1
                     and tuple(found[0].shape) == (scheme["head_dim"],) * 2 and bool((found[0].abs() == 1).all())))
        for target in online[0]["targets"]:
            rows.append((f"{target}: no bias on an online-transformed Linear", f"{target}.bias" not in tensors))
    groups = {t: g for g, s in tc.items() for a in s["apply"] if a["location"] == "input" for t in a["targets"]}
    for layer in range(2):
        for sib in siblings:
            names = [f"model.layers.{layer}.{'self_attn' if 'q_proj' in sib else 'mlp'}.{p}" for p in sib]
            rows.append((f"fused {'/'.join(sib)} share one input transform", len({groups.get(n) for n in names}) == 1))
    failed = [what for what, ok in rows if not ok]
    assert not failed, failed


def test_modelopt_fused_only(tmp_path):
    fused = _rotated("r1r2")
    out = export_checkpoint(fused, tmp_path / "mo", "modelopt")
    assert torch.equal(_logits(load_checkpoint(out)), _logits(fused))
    online = _rotated("r4")
    with pytest.raises(ValueError, match="modelopt checkpoints cannot hold online rotations .*down_proj.*'R4'"):
        export_checkpoint(online, tmp_path / "mo2", "modelopt")
    assert not (tmp_path / "mo2").exists()


def test_matrix_under_each_module_also_loads(tmp_path):
    """A checkpoint storing the matrix under every module's key (another producer's choice) loads the same."""
    model = _rotated("block:16")
    out = export_checkpoint(model, tmp_path / "ck")
    rot = input_rotations(model)

    def add(t):
        for name, (group, r) in rot.items():
            t[f"{name}.{group}_input.weight"] = r.signed.float()
    _edit(out, add)
    back = load_checkpoint(out, verify=False)
    assert len(input_rotations(back)) == len(rot) == 14
    assert torch.equal(_logits(back), _logits(model))


@pytest.mark.parametrize("edit, match", [
    (lambda t, k: t.__setitem__(k, t[k] / 4.0), "exactly \\+1 or -1"),
    (lambda t, k: t.__setitem__(k, torch.ones(16, 16)), "not orthogonal"),
    (lambda t, k: t.__setitem__(k, torch.ones(8, 8)), "expected \\[16, 16\\]"),
])
def test_loader_refuses_bad_matrices(tmp_path, edit, match):
    out = export_checkpoint(_rotated("block:16"), tmp_path / "ck")
    key = next(k for k in load_file(str(out / "model.safetensors")) if k.endswith("v_input.weight"))
    _edit(out, lambda t: edit(t, key))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(out, verify=False)


@pytest.mark.parametrize("change, match", [
    (lambda s: s["apply"][0].__setitem__("location", "output"), "'output' transforms are not supported"),
    (lambda s: s.__setitem__("randomize", True), "randomize"),
    (lambda s: s.__setitem__("block_size", 16), "unknown field"),
    (lambda s: s.__setitem__("type", "random-matrix"), "must be one of"),
    (lambda s: s.__setitem__("head_dim", 24), "not a multiple"),
])
def test_loader_refuses_bad_transform_configs(tmp_path, change, match):
    out = export_checkpoint(_rotated("block:16"), tmp_path / "ck")
    cfg = _config(out)
    change(cfg["quantization_config"]["transform_config"]["config_groups"]["v"])
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(out, verify=False)


def test_missing_matrix_is_named(tmp_path):
    out = export_checkpoint(_rotated("r4"), tmp_path / "ck")
    _edit(out, lambda t: [t.pop(k) for k in list(t) if k.endswith("R4_input.weight")])
    with pytest.raises(CheckpointError, match="no stored matrix for model.layers.0.mlp.down_proj"):
        load_checkpoint(out, verify=False)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_transformers_generates_like_bs_load(tmp_path):
    """Plain transformers + compressed-tensors on a W4A16 export with fused rotations (R1 / R2 live in the weights,
    lm_head untied): the same greedy tokens as ``bs.load``."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_model(model, PTQConfig(rotate="r1r2"), progress=False)
    out = export_checkpoint(model, tmp_path / "ck")
    assert _config(out)["tie_word_embeddings"] is False
    hf = AutoModelForCausalLM.from_pretrained(out)
    ours = bs.load(out)
    gen = hf.generate(IDS, max_new_tokens=5, do_sample=False)
    assert torch.equal(gen, ours.generate(IDS, max_new_tokens=5, do_sample=False))
    assert (hf(IDS).logits.float() - _logits(ours)).abs().max() < 0.02


@pytest.mark.filterwarnings("ignore:.*online input rotation:UserWarning")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma", "phi3"])
def test_families_round_trip(tmp_path, family):
    from tiny_models import tiny_family

    model = tiny_family(family, n_kv=2)
    quantize_model(model, PTQConfig(activations="w4a4", rotate="r1r2+block:16"), CALIB, progress=False)
    out = export_checkpoint(model, tmp_path / "ck")
    back = load_checkpoint(out)
    assert len(input_rotations(back)) == len(input_rotations(model)) > 0
    assert torch.equal(_logits(back), _logits(model))


def test_biased_rotated_linears_warn(tmp_path):
    from tiny_models import tiny_family

    model = tiny_family("qwen2", n_kv=2)
    quantize_model(model, PTQConfig(rotate="quip"), CALIB, progress=False)
    with pytest.warns(UserWarning, match="vLLM's transform loader refuses online transforms on biased Linears"):
        export_checkpoint(model, tmp_path / "ck")


@pytest.mark.parametrize("rotate", ["quip", "block:16", "r4"])
def test_compressed_tensors_applies_our_transform_config_like_we_do(rotate):
    """compressed-tensors' own ``apply_transform_config`` of the config we write, on the full-precision model, fuses
    the same weights (within FP rounding) and registers the same ±1 matrices as our ``rotate_model``."""
    import copy

    from compressed_tensors.transform import TransformConfig, apply_transform_config

    from blockscale.export.ct_transforms import transform_config
    from blockscale.ptq.rotations import parse_rotate, rotate_model

    fp = tiny_hf_llama()
    ours = copy.deepcopy(fp)
    rotate_model(ours, parse_rotate(rotate))
    rotations = input_rotations(ours)
    cfg, _ = transform_config(rotations, torch.float32)
    theirs = copy.deepcopy(fp)
    apply_transform_config(theirs, TransformConfig.model_validate(cfg))
    for name, (group, rot) in rotations.items():
        a, b = ours.get_submodule(name).weight, theirs.get_submodule(name).weight
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), name
        stored = theirs.get_submodule(f"{name}.{group}_input").weight
        assert torch.equal(stored.double(), rot.signed), name
    assert (_logits(ours) - _logits(theirs)).abs().max() < 1e-5


def test_class_targets_as_llm_compressor_writes_them(tmp_path):
    """llm-compressor's QuIP targets the class ``Linear`` and ignores ``lm_head``: the same rotations load."""
    model = _rotated("block:16")
    out = export_checkpoint(model, tmp_path / "ck")
    cfg = _config(out)
    for a in cfg["quantization_config"]["transform_config"]["config_groups"]["v"]["apply"]:
        a["targets"], a["ignore"] = ["Linear"], ["lm_head"]
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_checkpoint(out, verify=False)
    assert set(input_rotations(back)) == set(input_rotations(model))
    assert torch.equal(_logits(back), _logits(model))
