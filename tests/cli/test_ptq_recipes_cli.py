"""PTQConfig.recipe and the command line of PTQ recipes (issue 15): ``PTQConfig.ptq_recipe`` / label /
calibration / to_dict, ``blockscale recipes`` (training and PTQ sections, YAML of either) and
``blockscale quantize --recipe`` (one-line errors, the flags applied to the recipe)."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from cli_runs import run_cli as _run
from blockscale.errors import UsageError
from blockscale.ptq import PTQConfig
from blockscale.quant import NVFP4
from blockscale.recipes import (DEFAULT_EXCLUDE, KVCacheScheme, PTQRecipe, PTQRule, Scheme, get_ptq_recipe,
                                list_recipes, ptq_recipe_from_dict, save_ptq_recipe)

pytestmark = pytest.mark.usefixtures("one_thread")
BUILTINS = ("fp8", "mxfp4-w4a16", "nvfp4", "nvfp4-experts-fp8-attention")


def _every_feature_recipe() -> PTQRecipe:
    return PTQRecipe(name="cli", default=Scheme("nvfp4-w4a4", "4over6"),
                     rules=(PTQRule("attention", Scheme("fp8-w8a8", weights="channel")),
                            PTQRule("re:down_proj$", Scheme("mxfp8"))),
                     ignore=("lm_head",), kv_cache=KVCacheScheme(per_head=True))


# ----------------------------------------------------------------------------- PTQConfig

def test_ptq_config_without_a_recipe_is_unchanged():
    c = PTQConfig()
    assert "recipe" not in c.to_dict() and c.recipe is None
    assert c.ptq_recipe == PTQRecipe.single(Scheme("nvfp4-w4a16"), ignore=DEFAULT_EXCLUDE)
    assert c.label == "rtn 6 w4a16" and not c.needs_calibration
    w = PTQConfig(activations="w4a4", scale_rule="4over6", error="mae", act_scale_rule="4over6", exclude=("x",))
    assert w.ptq_recipe.default == Scheme("nvfp4-w4a4", "4over6", "mae", "4over6")
    assert w.ptq_recipe.ignore == ("x",) and w.ptq_recipe.rules == () and w.ptq_recipe.kv_cache is None
    assert w.needs_calibration and w.label == "rtn 4over6-mae w4a4 a:4over6"
    # act_scale_rule has no effect on weights-only NVFP4: accepted as before, not part of the scheme
    assert PTQConfig(act_scale_rule="4over6").ptq_recipe.default == Scheme("nvfp4-w4a16")


def test_ptq_config_with_a_recipe():
    c = PTQConfig(recipe="nvfp4-experts-fp8-attention")
    assert c.recipe is get_ptq_recipe("nvfp4-experts-fp8-attention") and c.ptq_recipe is c.recipe
    assert c.needs_calibration
    assert c.label == "rtn nvfp4-experts-fp8-attention (nvfp4-w4a4, fp8-w8a8, kv fp8-e4m3)"
    assert ptq_recipe_from_dict(c.to_dict()["recipe"]) == c.recipe
    assert list(c.to_dict()) == [*PTQConfig().to_dict()][:6] + ["recipe"] + [*PTQConfig().to_dict()][6:]
    assert not PTQConfig(recipe="mxfp4-w4a16").needs_calibration
    assert PTQConfig(method="gptq", recipe="mxfp4-w4a16").needs_calibration  # the method calibrates
    assert PTQConfig(recipe=PTQRecipe(default=Scheme("fp8-w8a8", activations="dynamic"))).needs_calibration is False
    assert PTQConfig(recipe="nvfp4").weight_spec == NVFP4()
    with pytest.raises(UsageError, match="not NVFP4"):
        PTQConfig(recipe="fp8").weight_spec
    for flat in ({"scale_rule": "sweep"}, {"error": "mae"}, {"activations": "w4a4"}, {"act_scale_rule": "4over6"},
                 {"exclude": ("lm_head",)}):
        with pytest.raises(UsageError, match=f"{next(iter(flat))} cannot be combined with recipe='fp8'"):
            PTQConfig(recipe="fp8", **flat)
    with pytest.raises(UsageError, match="expected a PTQRecipe"):
        PTQConfig(recipe=3)
    assert dataclasses.replace(c, recipe=None) == PTQConfig()


# ----------------------------------------------------------------------------- command line


def _one_error_line(result, cmd: str, *parts: str) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"blockscale {cmd}: error: "), err
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def test_recipes_lists_training_then_ptq_recipes(capsys):
    code, out, _ = _run(["recipes"], capsys)
    assert code == 0
    training, _, ptq = out.partition("PTQ recipes")
    assert training.startswith("training recipes")
    for name in list_recipes():
        assert f"  {name} " in training
    for name in BUILTINS:
        line = next(ln for ln in ptq.splitlines() if ln.split()[:1] == [name])
        assert get_ptq_recipe(name).description in line
    assert "--ptq" in ptq
    code, out, _ = _run(["recipes", "--ptq"], capsys)
    assert code == 0 and out.startswith("PTQ recipes") and "nvfp4-nvidia" not in out


def test_recipes_prints_a_ptq_recipe_as_yaml(capsys, tmp_path):
    for argv in (["recipes", "nvfp4-experts-fp8-attention"], ["recipes", "--ptq", "nvfp4-experts-fp8-attention"]):
        code, out, _ = _run(argv, capsys)
        assert code == 0 and ptq_recipe_from_dict(yaml.safe_load(out)) == get_ptq_recipe("nvfp4-experts-fp8-attention")
    save_ptq_recipe(_every_feature_recipe(), tmp_path / "mine.yaml")
    code, out, _ = _run(["recipes", tmp_path / "mine.yaml"], capsys)
    assert code == 0 and ptq_recipe_from_dict(yaml.safe_load(out)) == _every_feature_recipe()
    code, out, _ = _run(["recipes", "nvfp4-nvidia"], capsys)  # still the training recipe
    assert code == 0 and "linear" in yaml.safe_load(out)
    _one_error_line(_run(["recipes", "--ptq", "nvfp4-nvidia"], capsys), "recipes", "training recipe", "nvfp4-nvidia")
    _one_error_line(_run(["recipes", "nvfp5"], capsys), "recipes", "nvfp5", "nvfp4-experts-fp8-attention", "bf16")


@pytest.fixture
def quantize_argv(tmp_path):
    return ["quantize", "stories260k", "--out", tmp_path / "out"]


def test_quantize_recipe_errors_are_one_line(quantize_argv, tmp_path, capsys):
    q = quantize_argv
    _one_error_line(_run(q + ["--recipe", "nvfp5"], capsys), "quantize", "--recipe nvfp5",
                    "neither a built-in PTQ recipe", "nvfp4-experts-fp8-attention")
    _one_error_line(_run(q + ["--recipe", "nvfp4-nvidia"], capsys), "quantize", "training recipe")
    (tmp_path / "bad.yaml").write_text("name: x\nrules:\n  - {match: attention, scheme: fp8-w8a8, extra: 1}\n")
    _one_error_line(_run(q + ["--recipe", tmp_path / "bad.yaml"], capsys), "quantize", "--recipe",
                    "bad.yaml", "['extra']", "['match', 'scheme']")
    (tmp_path / "multi.yaml").write_text("name: x\ndefault: {name: fp8-w8a8, weights: [a,\n  b\n")
    _one_error_line(_run(q + ["--recipe", tmp_path / "multi.yaml"], capsys), "quantize", "not valid YAML")
    (tmp_path / "dir.yaml").mkdir()
    _one_error_line(_run(q + ["--recipe", tmp_path / "dir.yaml"], capsys), "quantize", "a directory")
    _one_error_line(_run(q + ["--recipe", "fp8", "--w4a4"], capsys), "quantize", "--w4a4", "--recipe",
                    "the recipe sets each scheme's activations")
    _one_error_line(_run(q + ["--recipe", "fp8", "--weights-only"], capsys), "quantize", "--weights-only")
    _one_error_line(_run(q + ["--recipe", "fp8", "--scale-rule", "sweep"], capsys), "quantize",
                    "--scale-rule sweep", "no NVFP4 scheme")
    _one_error_line(_run(q + ["--recipe", "nvfp4", "--act-scale-rule", "4over6"], capsys), "quantize",
                    "--act-scale-rule 4over6", "nvfp4-w4a4")


def test_quantize_passes_the_recipe_with_the_flags_applied(quantize_argv, monkeypatch, capsys):
    import blockscale.ptq.pipeline as pipeline

    seen = []

    def capture(model, tokenizer, cfg, *args, **kwargs):
        seen.append(cfg)
        raise UsageError("captured")

    monkeypatch.setattr(pipeline, "calibrate_and_quantize", capture)
    _run(quantize_argv + ["--recipe", "nvfp4-experts-fp8-attention", "--scale-rule", "sweep", "--exclude", "o_proj"],
         capsys)
    want = get_ptq_recipe("nvfp4-experts-fp8-attention").with_nvfp4(scale_rule="sweep")
    assert seen[-1].recipe == want.replace(ignore=DEFAULT_EXCLUDE + ("o_proj",))
    assert seen[-1].ptq_recipe.default == Scheme("nvfp4-w4a4", "sweep")
    _run(quantize_argv + ["--scale-rule", "4over6", "--w4a4"], capsys)  # no recipe: the flat fields, as before
    assert seen[-1] == PTQConfig(scale_rule="4over6", activations="w4a4", skip_indivisible=True)
    _run(quantize_argv, capsys)
    assert seen[-1] == PTQConfig(skip_indivisible=True)


def test_quantize_with_a_recipe_prints_the_schemes_and_folds_the_skipped_linears(quantize_argv, capsys):
    code, out, err = _run(quantize_argv + ["--recipe", "mxfp4-w4a16"], capsys)
    assert code == 0, err
    assert "schemes: mxfp4-w4a16 (30 Linears): model.layers.*.self_attn.q_proj (5)," in out
    assert "(rtn mxfp4-w4a16 (mxfp4-w4a16))" in out
    # stories260K's down_proj (in_features 172) is not whole MX blocks of 32: one warning line
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not a multiple of 32: model.layers.*.mlp.down_proj (5)" in lines[0], err


def test_quantize_refuses_an_activation_rule_without_w4a4_activations(quantize_argv, capsys):
    """--act-scale-rule without --w4a4 (or a recipe) has no activations to act on: refused, not silently dropped."""
    _one_error_line(_run(quantize_argv + ["--act-scale-rule", "4over6"], capsys), "quantize",
                    "--act-scale-rule 4over6", "--w4a4")
