"""Checkpoint formats behind one protocol (``blockscale.export.registry`` + ``codecs``): a third format,
defined here (a ``CheckpointFormat`` and its NVFP4 ``TensorCodec``) and registered from this file only,
is written and read by the unchanged ``export_checkpoint`` / ``load_checkpoint`` under its own tensor
names, config and side file, is found by the one detector
(``models.checkpoint_detection``, which ``models.hf`` shares), and disappears again when unregistered;
checkpoint.py and load.py never name a format."""
import ast
import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

import blockscale.export as ex
from blockscale.export import (CheckpointError, CheckpointFormat, ModuleScheme, ParsedConfig, TensorCodec,
                               checkpoint_format, export_checkpoint, load_checkpoint)
from blockscale.export import tensor_kinds
from blockscale.export.codecs import codecs_of
from blockscale.export.stored_checks import nvfp4_stored
from blockscale.models.checkpoint_detection import directory_format
from blockscale.models.hf import is_blockscale_checkpoint

from nvfp4_checkpoints import CT, MO, make_model, model_logits, nvfp4_linears  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

# ---- a test-only checkpoint format: S stored as an FP32 scalar, its own names and a side file -------
NAME, METHOD, SIDE = "blockscale-test", "blockscale-test", "test_quant_config.json"
NAMES = {"weight_packed": "codes", "weight_scale": "block_scales", "weight_global_scale": "encode_scale",
         "input_global_scale": "input_encode_scale"}
CHECKED: list[str] = []  # module names check_module saw


def _qcfg(schemes: dict, ignore: list, producer: dict, blockscale: dict, kv) -> dict:
    w4a4 = any(s.inputs for s in schemes.values())
    return {"quant_method": METHOD, "activations": "nvfp4" if w4a4 else None, "blockscale": blockscale}


def _side(schemes: dict, ignore: list, producer: dict, kv) -> dict:
    return {SIDE: {"skip": list(ignore), "producer": producer}}


def _export(s: ModuleScheme, bufs: dict) -> dict:
    return {NAMES[b]: t.detach().to(torch.float32).reshape(()) if b.endswith("global_scale") else t
            for b, t in bufs.items()}


def _check(name: str, m, s: ModuleScheme) -> None:
    CHECKED.append(name)


def _detects(qcfg: Optional[dict], has_file) -> bool:
    return qcfg is not None and qcfg.get("quant_method") == METHOD and has_file(SIDE)


def _parse(qcfg: Optional[dict], side: dict) -> ParsedConfig:
    skip = set(side[SIDE]["skip"])
    s = ModuleScheme("nvfp4", "nvfp4", "nvfp4" if qcfg.get("activations") == "nvfp4" else None)
    return ParsedConfig(scheme_of=lambda name: None if name in skip else s)


def _expected(s: ModuleScheme, out_features: int, in_features: int) -> dict:
    d = {"codes": ((torch.uint8,), ((out_features, in_features // 2),)),
         "block_scales": ((torch.float8_e4m3fn,), ((out_features, in_features // 16),)),
         "encode_scale": ((torch.float32,), ((),))}
    if s.inputs:
        d["input_encode_scale"] = ((torch.float32,), ((),))
    return d


def _read(s: ModuleScheme, t: dict) -> dict:
    out = {"weight_packed": t["codes"], "weight_scale": t["block_scales"], "weight_global_scale": t["encode_scale"].reshape(1)}
    if "input_encode_scale" in t:
        out["input_global_scale"] = t["input_encode_scale"].reshape(1)
    return out


TEST_FORMAT = CheckpointFormat(
    name=NAME, quant_method=METHOD, aliases=("bst",), quantization_config=_qcfg, detects=_detects, parse=_parse,
    side_files=_side, side_file_names={SIDE: "test quantization config"})
TEST_CODEC = TensorCodec(
    format=NAME, kind=tensor_kinds.NVFP4, export=_export, read=_read, expected=_expected, describe=lambda s: "nvfp4",
    check_stored=nvfp4_stored(NAMES, lambda stored: 1.0 / stored.to(torch.float32)), check=_check,
    siblings_share=lambda s: ("encode_scale",) + (("input_encode_scale",) if s.inputs else ()))


@pytest.fixture
def registered():
    ex.register_format(TEST_FORMAT)
    ex.register_codec(TEST_CODEC)
    CHECKED.clear()
    yield TEST_FORMAT
    ex.unregister_format(NAME)


# ---- the format round-trips through the unchanged export / load -----------------------------------
@pytest.mark.parametrize("act", [None, "6"])
def test_a_third_format_writes_and_reads_its_own_names(tmp_path, registered, act):
    model = make_model(act=act, layers=1, bias=True)
    ref = model_logits(model)
    out = export_checkpoint(model, tmp_path / "bst", "BST")  # an alias, any case
    ct = export_checkpoint(model, tmp_path / "ct", CT)
    quantized = nvfp4_linears(model)
    assert CHECKED == list(quantized)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == METHOD
    assert cfg["quantization_config"]["blockscale"]["format"] == NAME
    assert cfg["dtype"] == "float32"  # no serving_dtype: the model's
    side = json.loads((out / SIDE).read_text())
    assert side["skip"] == json.loads((ct / "config.json").read_text())["quantization_config"]["ignore"]
    assert SIDE in json.loads((out / "blockscale_report.json").read_text())["written_files"]

    t, t_ct = load_file(str(out / "model.safetensors")), load_file(str(ct / "model.safetensors"))
    for n, m in quantized.items():
        assert torch.equal(t[f"{n}.codes"], t_ct[f"{n}.weight_packed"])
        assert torch.equal(t[f"{n}.block_scales"].view(torch.uint8), t_ct[f"{n}.weight_scale"].view(torch.uint8))
        assert t[f"{n}.encode_scale"].shape == () and torch.equal(t[f"{n}.encode_scale"].reshape(1),
                                                                    m.weight_global_scale)
        assert (f"{n}.input_encode_scale" in t) == (act is not None)
        assert not any(k.startswith(f"{n}.weight_") for k in t)
    assert {k for k in t if k.rpartition(".")[0] not in quantized} == \
        {k for k in t_ct if k.rpartition(".")[0] not in quantized}

    assert checkpoint_format(out) == NAME and directory_format(out) == NAME and is_blockscale_checkpoint(out)
    back = load_checkpoint(out)
    assert torch.equal(model_logits(back), ref)
    for n, m in nvfp4_linears(back).items():
        assert torch.equal(m.weight_global_scale, quantized[n].weight_global_scale)
        assert m.input_scale_rule == quantized[n].input_scale_rule


def test_the_format_is_validated_like_the_others(tmp_path, registered):
    out = export_checkpoint(make_model(layers=1), tmp_path / "bst", NAME)
    (out / SIDE).unlink()  # its detector needs the side file
    with pytest.raises(CheckpointError, match="not an NVFP4 checkpoint"):
        load_checkpoint(out)
    assert not is_blockscale_checkpoint(out)


def test_unregistered_it_is_gone(tmp_path, registered):
    out = export_checkpoint(make_model(layers=1), tmp_path / "bst", NAME)
    ex.unregister_format(NAME)
    assert NAME not in ex.FORMATS and list(ex.FORMATS) == [CT, MO] and not codecs_of(NAME)
    with pytest.raises(ValueError, match=r"format='bst'; supported: 'compressed-tensors'"):
        ex.format_named("bst")
    assert directory_format(out) is None and not is_blockscale_checkpoint(out)
    with pytest.raises(CheckpointError, match=r"not an NVFP4 checkpoint .*'blockscale-test'"):
        load_checkpoint(out)


def test_registration_refuses_clashes_and_incomplete_names(registered):
    import dataclasses

    with pytest.raises(ValueError, match=r"'ct' is already registered by 'compressed-tensors'"):
        ex.register_format(dataclasses.replace(TEST_FORMAT, name="other", aliases=("ct",)))
    with pytest.raises(TypeError, match="CheckpointFormat"):
        ex.register_format({"name": "other"})
    with pytest.raises(TypeError, match="TensorCodec"):
        ex.register_codec({"format": "other"})
    assert set(ex.FORMATS) == {CT, MO, NAME}


# ---- export and load never name a format ----------------------------------------------------------
@pytest.mark.parametrize("module", ["checkpoint", "load", "export_plan", "load_plan"])
def test_export_and_load_never_branch_on_a_format_name(module):
    path = Path(ex.__file__).parent / f"{module}.py"
    tree = ast.parse(path.read_text())
    names = {n for f in ex.FORMATS.values() for n in (f.name, f.quant_method, *f.aliases)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.module not in ("compressed_tensors", "modelopt"), f"{path.name} imports {node.module}"
            assert not {a.name for a in node.names} & {"compressed_tensors", "modelopt"}
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                assert not (isinstance(operand, ast.Constant) and operand.value in names), ast.unparse(node)
                assert not (isinstance(operand, ast.Attribute) and operand.attr == "NAME"), ast.unparse(node)
