"""``bs.BlockscaleConfig``: its options (recipe forms, scale rules, ignore), one clear error per bad value, the
one-line refusal of everything that needs calibration, its JSON form, its registration with transformers, and
``import blockscale`` without transformers."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import blockscale as bs  # noqa: E402
from blockscale.errors import UsageError  # noqa: E402

ELSEWHERE = "use bs.quantize_model (PTQConfig) or `blockscale quantize`"


def test_hf_defaults_are_the_nvfp4_recipe():
    cfg = bs.BlockscaleConfig()
    assert cfg.ptq_recipe == bs.get_ptq_recipe("nvfp4")
    assert cfg.ptq_config == bs.PTQConfig(recipe=bs.get_ptq_recipe("nvfp4"))
    assert cfg.quant_method == "blockscale"


def test_hf_recipe_forms(tmp_path):
    four_six = bs.get_ptq_recipe("nvfp4").with_nvfp4(scale_rule="4over6")
    assert bs.BlockscaleConfig(recipe="nvfp4", scale_rule="4over6").ptq_recipe == four_six
    assert bs.BlockscaleConfig(recipe="mxfp4").ptq_recipe == bs.PTQRecipe.single(bs.Scheme("mxfp4"))
    dynamic = bs.Scheme("fp8-w8a8", activations="dynamic")
    assert bs.BlockscaleConfig(recipe=dynamic).ptq_recipe == bs.PTQRecipe.single(dynamic)
    mine = bs.PTQRecipe(name="mine", default=bs.Scheme("nvfp4-w4a16", scale_rule="sweep"),
                        rules=(bs.PTQRule("attention", bs.Scheme("mxfp8")),))
    assert bs.BlockscaleConfig(recipe=mine).ptq_recipe == mine
    bs.save_ptq_recipe(mine, tmp_path / "mine.yaml")
    assert bs.BlockscaleConfig(recipe=str(tmp_path / "mine.yaml")).ptq_recipe == mine
    extra = bs.BlockscaleConfig(recipe=mine, ignore=[r"\.o_proj$"]).ptq_recipe
    assert extra.ignore == mine.ignore + (r"\.o_proj$",) and extra.default == mine.default


@pytest.mark.parametrize("recipe", ["nvfp4", bs.Scheme("nvfp4-w4a16", scale_rule="sweep"),
                                    bs.PTQRecipe(name="x", ignore=("a",))])
def test_hf_json_round_trip(recipe):
    from transformers.quantizers.auto import AutoQuantizationConfig

    cfg = bs.BlockscaleConfig(recipe=recipe, scale_rule="4over6", error="maxabs", ignore=["mlp"],
                              expert_outer_scale="tensor", skip_indivisible=True)
    d = json.loads(json.dumps(cfg.to_dict()))
    back = AutoQuantizationConfig.from_dict(d)  # what transformers does with a config.json's quantization_config
    assert type(back) is bs.BlockscaleConfig and back.ptq_config == cfg.ptq_config and back.to_dict() == d
    assert dict(cfg) == d and json.loads(cfg.to_json_string()) == d


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe="nvfp5"), "recipe='nvfp5' is not supported; allowed values: 'fp8', 'mxfp4-w4a16', 'nvfp4'"),
    (dict(recipe="nvfp4-nvidia"), "recipe='nvfp4-nvidia' is a training recipe (bs.convert), not a PTQ recipe"),
    (dict(recipe=3), "recipe=3 is not supported; allowed values:"),
    (dict(scale_rule="5"), "scale_rule='5' is not supported; allowed values: None (the recipe's own), '6', '4over6', "
                           "'sweep'"),
    (dict(error="l2"), "error='l2' is not supported; allowed values: None (the recipe's own), 'mse', 'mae', 'maxabs'"),
    (dict(recipe="mxfp4", scale_rule="4over6"), "scale_rule='4over6': PTQ recipe 'mxfp4' has no NVFP4 scheme"),
    (dict(ignore="lm_head"), "ignore='lm_head': expected a list of regular expressions"),
    (dict(ignore=["(unclosed"]), "ignore: '(unclosed' is not a valid regular expression"),
    (dict(method="fast"), "method='fast' is not supported; allowed values: 'rtn'"),
    (dict(expert_outer_scale="layer"), "expert_outer_scale='layer' is not supported; allowed values: 'expert', "
                                       "'tensor'"),
    (dict(skip_indivisible="yes"), "skip_indivisible='yes': expected True or False"),
    (dict(bits=4), "BlockscaleConfig: unknown argument(s) ['bits']; allowed: recipe, scale_rule"),
    (dict(quant_method="fp8"), "quant_method='fp8': a BlockscaleConfig is quant_method 'blockscale'"),
])
def test_hf_bad_values_name_the_argument_and_the_allowed_values(kwargs, message):
    with pytest.raises(UsageError) as err:
        bs.BlockscaleConfig(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, what", [
    (dict(method="gptq"), "method='gptq' needs calibration data"),
    (dict(method="awq"), "method='awq' needs calibration data"),
    (dict(method="smoothquant"), "method='smoothquant' needs calibration data"),
    (dict(method="autoround"), "method='autoround' needs calibration data"),
    (dict(scale_rule="hessian"), "scale_rule='hessian' weights block errors by calibration statistics"),
    (dict(scale_rule="hessian-4over6"), "scale_rule='hessian-4over6' weights block errors"),
    (dict(recipe="nvfp4-w4a4"), "scheme nvfp4-w4a4 has static (calibrated) activation scales"),
    (dict(recipe="fp8"), "scheme fp8-w8a8 has static (calibrated) activation scales"),
    (dict(recipe="nvfp4-experts-fp8-attention"), "quantizes the KV cache (kv fp8-e4m3) with calibrated scales"),
    (dict(recipe=bs.PTQRecipe(default=bs.Scheme("nvfp4-w4a16", scale_rule="hessian"))),
     "scheme nvfp4-w4a16 hessian chooses block scales from calibration statistics"),
])
def test_hf_calibrated_methods_are_refused_in_one_line(kwargs, what):
    with pytest.raises(UsageError) as err:
        bs.BlockscaleConfig(**kwargs)
    message = str(err.value)
    assert what in message and ELSEWHERE in message and "\n" not in message


def test_hf_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    from blockscale.hf import BlockscaleHfQuantizer, register

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["blockscale"] is bs.BlockscaleConfig
    assert AUTO_QUANTIZER_MAPPING["blockscale"] is BlockscaleHfQuantizer
    register()  # again: finds them registered
    assert AUTO_QUANTIZER_MAPPING["blockscale"] is BlockscaleHfQuantizer


def test_import_blockscale_does_not_import_transformers():
    code = ("import sys, blockscale as bs; assert 'transformers' not in sys.modules, 'imported early'; "
            "cfg = bs.BlockscaleConfig(); assert 'transformers' in sys.modules; print(type(cfg).__module__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "blockscale.hf.config"
