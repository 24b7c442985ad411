"""Recipes as data: built-ins, YAML round trip, validation."""
import dataclasses

import pytest
import yaml

import blockscale as bs
from blockscale.recipes import (LinearRecipe, Recipe, get_recipe, list_recipes, load_recipe_file,
                                save_recipe)

BUILTINS = ["bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-nvidia", "nvfp4-nvidia-4over6"]


def test_builtin_recipes_exist():
    assert list_recipes() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_yaml_round_trip(name, tmp_path):
    r = get_recipe(name)
    path = tmp_path / f"{name}.yaml"
    save_recipe(r, path)
    assert load_recipe_file(path) == r
    assert get_recipe(str(path)) == r
    assert yaml.safe_load(path.read_text())["name"] == name


def test_builtin_contents():
    nv = get_recipe("nvfp4-nvidia").linear
    assert nv.fprop_weight == bs.NVFP4(block_2d=True) and nv.fprop_input == bs.NVFP4()
    assert nv.dgrad_grad.rounding == nv.wgrad_grad.rounding == "stochastic"
    assert nv.fprop_input.rounding == nv.wgrad_input.rounding == "nearest"  # SR on gradients only
    assert nv.wgrad_hadamard == 16 and nv.hadamard_signs == "te" and nv.reuse_fprop_weight
    assert get_recipe("nvfp4-nvidia").last_blocks_recipe == "bf16"
    assert get_recipe("nvfp4-nvidia").n_last_blocks(20) == 3  # ~15%
    n46 = get_recipe("nvfp4-nvidia-4over6").linear
    assert n46.fprop_input.scale_rule == "4over6" and n46.fprop_input.error == "mse"
    fb = get_recipe("nvfp4-fwd-mxfp8-bwd")
    assert fb.linear.fprop_input == bs.NVFP4(outer="row", scale_rule="4over6")
    assert fb.linear.fprop_weight == bs.NVFP4()
    for op in ("dgrad_grad", "dgrad_weight", "wgrad_grad", "wgrad_input"):
        assert getattr(fb.linear, op) == bs.MX(element="e4m3", rounding="stochastic")
    assert fb.last_blocks_recipe == "mxfp8" and fb.n_last_blocks(6) == 1 and fb.n_last_blocks(12) == 2
    mx = get_recipe("mxfp8").linear
    assert mx.fprop_input == bs.MX() and mx.wgrad_grad == bs.MX(rounding="stochastic")
    assert not get_recipe("bf16").linear.quantized


def test_mse_or_mae_selectable(tmp_path):
    r = get_recipe("nvfp4-nvidia-4over6")
    mae = r.with_(linear=dataclasses.replace(r.linear, fprop_input=bs.NVFP4(scale_rule="4over6", error="mae")))
    save_recipe(mae, tmp_path / "mae.yaml")
    assert load_recipe_file(tmp_path / "mae.yaml").linear.fprop_input.error == "mae"


@pytest.mark.parametrize("text, match", [
    ("name: x\nlinear: {fprop_input: {format: nvfp5}}", "format='nvfp5'"),
    ("name: x\nlinear: {fprop_input: {format: nvfp4, scale_rule: '7'}}", "scale_rule='7'"),
    ("name: x\nlinear: {fprop_input: {format: nvfp4, colour: red}}", "unknown nvfp4 option"),
    ("name: x\nlinear: {fprop_inputs: null}", "unknown key"),
    ("name: x\nspeed: 3", "unknown key"),
    ("linear: {}", "missing 'name'"),
    ("name: x\nlast_blocks_fraction: 2", "last_blocks_fraction"),
    ("name: x\nlast_blocks_fraction: 0.2", "last_blocks_recipe"),
    ("name: x\nlinear: {wgrad_hadamard: 12}", "wgrad_hadamard=12"),
    ("name: x\nlinear: {wgrad_hadamard: 32}", "hadamard_signs='te'"),
    ("name: x\nexclude: ['(']", "not a valid regular expression"),
    ("name: x\nlinear: {dgrad_grad: {format: mx, dim: 0}}", "last"),
    ("- a\n- b", "expected a mapping"),
    ("name: [unclosed", "not valid YAML"),
    ("!!python/object/apply:os.system ['echo pwned']", "not valid YAML"),
])
def test_bad_recipe_files(tmp_path, text, match):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_recipe_file(p)


def test_get_recipe_errors():
    with pytest.raises(ValueError, match="neither a built-in recipe"):
        get_recipe("fp3")
    with pytest.raises(TypeError):
        get_recipe(3)
    r = Recipe(name="custom", linear=LinearRecipe(fprop_input=bs.NVFP4()))
    assert get_recipe(r) is r
