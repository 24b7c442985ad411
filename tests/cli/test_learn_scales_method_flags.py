"""learn-scales takes the PTQ method's options for a model-name input (the same --awq-* / --gptq-* flags as
quantize), e.g. the best W4A16 start of docs/results/recovery-models.md, and refuses them for a checkpoint input
(which was quantized already) instead of ignoring them."""
from __future__ import annotations

import pytest

from blockscale.cli.learn_scales_init import init_recipe, ptq_config
from blockscale.cli.main import build_parser
from blockscale.errors import UsageError
from blockscale.ptq import AWQOptions, GPTQOptions, RTNOptions


def _args(*extra):
    return build_parser().parse_args(["learn-scales", "smollm2-135m", "--out", "o", *extra])


def test_method_options_reach_the_ptq_start():
    c = ptq_config(_args("--method", "awq", "--awq-quantizer", "gptq", "--scale-rule", "hessian"), None)
    assert (c.method, c.scale_rule) == ("awq", "hessian")
    assert c.options == AWQOptions(quantizer="gptq", clip=False)  # auto-clip resolved off with GPTQ
    c = ptq_config(_args("--method", "gptq", "--gptq-damp", "0.05", "--scale-rule", "hessian"), None)
    assert c.options == GPTQOptions(damp=0.05)
    assert ptq_config(_args(), None).options == RTNOptions()


def test_method_flags_with_a_checkpoint_input_are_refused():
    with pytest.raises(UsageError, match="--awq-quantizer.*quantized checkpoint already"):
        init_recipe(_args("--awq-quantizer", "gptq"), is_ckpt=True)
    assert init_recipe(_args(), is_ckpt=True) is None


def test_act_scale_rule_reaches_the_ptq_start(tmp_path):
    from blockscale.recipes.ptq_recipe import PTQRecipe, Scheme
    from blockscale.recipes.ptq_serialize import save_ptq_recipe

    c = ptq_config(_args("--w4a4", "--act-scale-rule", "4over6"), None)
    assert (c.activations, c.act_scale_rule) == ("w4a4", "4over6")
    assert ptq_config(_args("--w4a4"), None).act_scale_rule == "6"
    save_ptq_recipe(PTQRecipe.single(Scheme("nvfp4-w4a4")), tmp_path / "w4a4.yaml")
    recipe = init_recipe(_args("--recipe", str(tmp_path / "w4a4.yaml"), "--act-scale-rule", "4over6"), is_ckpt=False)
    assert (recipe.default.name, recipe.default.act_scale_rule) == ("nvfp4-w4a4", "4over6")


@pytest.mark.parametrize("extra,is_ckpt,words", [
    (["--act-scale-rule", "4over6"], False, "add --w4a4"),
    (["--act-scale-rule", "4over6"], True, "quantized checkpoint already"),
    (["--w4a4", "--act-scale-rule", "4over6", "--learn-input-scales"], False, "--learn-input-scales"),
    (["--recipe", "nvfp4", "--act-scale-rule", "4over6"], False, "--act-scale-rule 4over6"),
])
def test_act_scale_rule_refusals(extra, is_ckpt, words):
    with pytest.raises(UsageError, match=words):
        init_recipe(_args(*extra), is_ckpt=is_ckpt)


def test_learn_input_scales_with_a_four_over_six_recipe_is_refused_before_the_ptq(tmp_path):
    """A W4A4 recipe whose activation rule is 4over6 (set in the YAML, not by the flag) cannot learn its input scales
    (they are learned under rule 6): refused with the flag's name before anything loads, not by lsq.enable after the
    PTQ; the same recipe with rule 6 passes."""
    from blockscale.recipes.ptq_recipe import PTQRecipe, Scheme
    from blockscale.recipes.ptq_serialize import save_ptq_recipe

    path = tmp_path / "w4a4-46.yaml"
    save_ptq_recipe(PTQRecipe.single(Scheme("nvfp4-w4a4", act_scale_rule="4over6")), path)
    with pytest.raises(UsageError, match="--learn-input-scales.*4over6"):
        init_recipe(_args("--recipe", str(path), "--learn-input-scales"), is_ckpt=False)
    assert init_recipe(_args("--recipe", str(path)), is_ckpt=False).default.act_scale_rule == "4over6"
    six = tmp_path / "w4a4-6.yaml"
    save_ptq_recipe(PTQRecipe.single(Scheme("nvfp4-w4a4")), six)
    with pytest.raises(UsageError, match="--learn-input-scales"):  # the flag overriding a rule-6 recipe
        init_recipe(_args("--recipe", str(six), "--act-scale-rule", "4over6", "--learn-input-scales"), False)
    assert init_recipe(_args("--recipe", str(six), "--learn-input-scales"), False).default.act_scale_rule in (None, "6")


def test_learn_scales_with_four_over_six_activations_exports_them(tmp_path, capsys):
    """--act-scale-rule 4over6: the student learns with Four Over Six on its activations and the export keeps it
    (the reloaded model's W4A4 Linears use rule 4over6)."""
    from blockscale import cli
    from blockscale.nn import NVFP4Linear
    from blockscale.ptq.pipeline import open_model

    out = tmp_path / "o"
    assert cli.main(["learn-scales", "stories260k", "--w4a4", "--act-scale-rule", "4over6", "--steps", "2",
                     "--n-samples", "4", "--seq-len", "32", "--batch-size", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    linears = [m for m in open_model(str(out)).model.modules() if isinstance(m, NVFP4Linear)]
    assert linears and all(m.input_scale_rule == "4over6" and m.input_global_scale is not None for m in linears)
