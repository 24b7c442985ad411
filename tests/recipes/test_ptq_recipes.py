"""PTQ recipes as data (issue 15): schemes, rules, KV cache, YAML round trip with unknown keys and bad
values refused, the built-ins, scheme assignment on a tiny Llama (module classes, globs, regexes, first
match wins, fused groups). PTQConfig.recipe and the command line: test_ptq_recipes_cli.py."""
from __future__ import annotations

import itertools

import pytest
import torch
import yaml
from torch import nn

from blockscale.errors import QuantizationError, UsageError
from blockscale.ptq import PTQConfig
from blockscale.ptq.scheme_plan import assign_schemes, describe_assignment, fold_names, module_classes
from blockscale.quant import FP8, MX, NVFP4
from blockscale.recipes import (DEFAULT_EXCLUDE, MODULE_CLASSES, SCHEME_NAMES, SCHEME_OPTIONS, KVCacheScheme,
                                PTQRecipe, PTQRule, Scheme, get_ptq_recipe, list_ptq_recipes,
                                load_ptq_recipe_file, ptq_recipe_from_dict, ptq_recipe_to_dict, save_ptq_recipe)

pytestmark = pytest.mark.usefixtures("one_thread")
BUILTINS = ("fp8", "mxfp4-w4a16", "nvfp4", "nvfp4-experts-fp8-attention")
OPTIONS = ("scale_rule", "error", "act_scale_rule", "weights", "activations")


# ----------------------------------------------------------------------------- schemes

def test_scheme_names_and_options_are_the_designed_ones():
    assert SCHEME_NAMES == ("nvfp4-w4a4", "nvfp4-w4a16", "fp8-w8a8", "fp8-block", "mxfp8", "mxfp4", "mxfp4-w4a16",
                            "bf16")
    assert MODULE_CLASSES == ("attention", "mlp", "experts", "shared_experts", "router")
    assert {n: set(o) for n, o in SCHEME_OPTIONS.items()} == {
        "nvfp4-w4a4": {"scale_rule", "error", "act_scale_rule"}, "nvfp4-w4a16": {"scale_rule", "error"},
        "fp8-w8a8": {"weights", "activations"}, "fp8-block": set(), "mxfp8": {"scale_rule"},
        "mxfp4": {"scale_rule"}, "mxfp4-w4a16": {"scale_rule"}, "bf16": set()}


def test_scheme_defaults_are_stored_resolved():
    assert Scheme("nvfp4-w4a4") == Scheme("nvfp4-w4a4", "6", "mse", "6")
    assert Scheme("nvfp4-w4a16").to_dict() == {"name": "nvfp4-w4a16", "scale_rule": "6", "error": "mse"}
    assert Scheme("fp8-w8a8").to_dict() == {"name": "fp8-w8a8", "weights": "tensor", "activations": "static"}
    assert Scheme("mxfp8").to_dict() == {"name": "mxfp8", "scale_rule": "ceil"}
    assert Scheme("fp8-block").to_dict() == {"name": "fp8-block"}
    assert Scheme("bf16").to_dict() == {"name": "bf16"}
    s = Scheme("fp8-block")
    assert (s.scale_rule, s.error, s.act_scale_rule, s.weights, s.activations) == (None,) * 5


def test_every_scheme_has_its_weight_spec_family_and_activations():
    expect = {
        "nvfp4-w4a4": (NVFP4(scale_rule="6", error="mse"), "nvfp4", True, True, 16),
        "nvfp4-w4a16": (NVFP4(scale_rule="6", error="mse"), "nvfp4", False, False, 16),
        "fp8-w8a8": (FP8("e4m3", granularity="tensor"), "fp8", True, True, None),
        "fp8-block": (FP8("e4m3", "block", (128, 128)), "fp8", True, False, None),
        "mxfp8": (MX("e4m3", scale_rule="ceil"), "mx", True, False, 32),
        "mxfp4": (MX("e2m1", scale_rule="ceil"), "mx", True, False, 32),
        "mxfp4-w4a16": (MX("e2m1", scale_rule="ceil"), "mx", False, False, 32),
        "bf16": (None, "none", False, False, None),
    }
    assert set(expect) == set(SCHEME_NAMES)
    for name, (spec, family, acts, static, block) in expect.items():
        s = Scheme(name)
        assert (s.weight_spec, s.family, s.quantizes_activations, s.static_activations, s.block_size) == \
            (spec, family, acts, static, block), name
    assert Scheme("nvfp4-w4a4", "4over6", "mae").weight_spec == NVFP4(scale_rule="4over6", error="mae")
    assert Scheme("nvfp4-w4a16", "sweep").weight_spec == NVFP4(scale_rule="sweep")
    assert Scheme("fp8-w8a8", weights="channel").weight_spec == FP8("e4m3", granularity="channel")
    assert Scheme("mxfp4", scale_rule="floor").weight_spec == MX("e2m1", scale_rule="floor")
    assert Scheme("mxfp8", scale_rule="floor").weight_spec == MX("e4m3", scale_rule="floor")
    assert not Scheme("fp8-w8a8", activations="dynamic").static_activations


def test_scheme_labels():
    assert Scheme("nvfp4-w4a4", "4over6").label == "nvfp4-w4a4 4over6-mse"
    assert Scheme("nvfp4-w4a4", "4over6", "mae", "4over6").label == "nvfp4-w4a4 4over6-mae a:4over6"
    assert Scheme("nvfp4-w4a16", "sweep").label == "nvfp4-w4a16 sweep"
    assert Scheme("fp8-w8a8", weights="channel", activations="dynamic").label == "fp8-w8a8 channel/dynamic"
    assert Scheme("fp8-w8a8").label == "fp8-w8a8"
    assert Scheme("mxfp4", scale_rule="floor").label == "mxfp4 floor"
    assert Scheme("bf16").label == "bf16"


@pytest.mark.parametrize("name,option", [(n, o) for n, o in itertools.product(SCHEME_NAMES, OPTIONS)
                                         if o not in SCHEME_OPTIONS[n]])
def test_an_option_a_scheme_does_not_take_is_refused(name, option):
    value = "tensor" if option == "weights" else "static" if option == "activations" else "6"
    with pytest.raises(UsageError) as exc:
        Scheme(name, **{option: value})
    msg = str(exc.value)
    assert repr(name) in msg and option in msg
    takers = [n for n in SCHEME_NAMES if option in SCHEME_OPTIONS[n]]
    assert ", ".join(takers) in msg


def test_bad_scheme_names_and_values_name_the_field_and_the_allowed_values():
    with pytest.raises(UsageError, match="'nvfp8'.*" + "'nvfp4-w4a4', 'nvfp4-w4a16'"):
        Scheme("nvfp8")
    for name, option, bad, allowed in [("nvfp4-w4a16", "scale_rule", "4", "'6', '4over6', 'sweep'"),
                                       ("nvfp4-w4a4", "error", "l2", "'mse', 'mae', 'maxabs'"),
                                       ("nvfp4-w4a4", "act_scale_rule", "sweep", "'6', '4over6'"),
                                       ("fp8-w8a8", "weights", "block", "'tensor', 'channel'"),
                                       ("fp8-w8a8", "activations", "token", "'static', 'dynamic'"),
                                       ("mxfp4", "scale_rule", "6", "'ceil', 'floor'")]:
        with pytest.raises(UsageError) as exc:
            Scheme(name, **{option: bad})
        assert f"{option}={bad!r}" in str(exc.value) and allowed in str(exc.value), str(exc.value)


def test_scheme_from_value():
    assert Scheme.from_value("fp8-block") == Scheme("fp8-block")
    assert Scheme.from_value({"name": "nvfp4-w4a4", "scale_rule": 6, "act_scale_rule": "4over6"}) == \
        Scheme("nvfp4-w4a4", "6", act_scale_rule="4over6")  # YAML reads `scale_rule: 6` as an int
    for s in (Scheme("fp8-w8a8", weights="channel", activations="dynamic"), Scheme("mxfp4", scale_rule="floor")):
        assert Scheme.from_value(s.to_dict()) == s
    with pytest.raises(UsageError, match=r"unknown key\(s\) \['bits'\] for scheme 'fp8-w8a8'; allowed: "
                                         r"\['name', 'weights', 'activations'\]"):
        Scheme.from_value({"name": "fp8-w8a8", "bits": 8})
    with pytest.raises(UsageError, match="missing 'name'"):
        Scheme.from_value({"scale_rule": "6"})
    with pytest.raises(UsageError, match="does not take weights"):
        Scheme.from_value({"name": "nvfp4-w4a16", "weights": "tensor"})
    with pytest.raises(UsageError, match="expected a scheme name"):
        Scheme.from_value(8)


# ----------------------------------------------------------------------------- recipes and YAML

def _every_feature_recipe() -> PTQRecipe:
    return PTQRecipe(
        name="every-feature", description="one of each",
        default=Scheme("nvfp4-w4a4", "4over6", "maxabs", "4over6"),
        rules=(PTQRule("attention", Scheme("fp8-w8a8", weights="channel", activations="dynamic")),
               PTQRule("re:\\.layers\\.0\\.mlp\\.", Scheme("bf16")),
               PTQRule("*.mlp.down_proj", Scheme("mxfp8", scale_rule="floor")),
               PTQRule("experts", Scheme("mxfp4")), PTQRule("shared_experts", Scheme("mxfp4-w4a16")),
               PTQRule("router", Scheme("fp8-block")), PTQRule("mlp", Scheme("nvfp4-w4a16", "sweep"))),
        ignore=("lm_head",), kv_cache=KVCacheScheme(per_head=True))


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_round_trip_through_yaml(name, tmp_path):
    recipe = get_ptq_recipe(name)
    assert ptq_recipe_from_dict(yaml.safe_load(yaml.safe_dump(ptq_recipe_to_dict(recipe)))) == recipe
    save_ptq_recipe(recipe, tmp_path / "r.yaml")
    assert load_ptq_recipe_file(tmp_path / "r.yaml") == recipe
    assert get_ptq_recipe(str(tmp_path / "r.yaml")) == recipe


def test_a_recipe_with_every_feature_round_trips(tmp_path):
    recipe = _every_feature_recipe()
    save_ptq_recipe(recipe, tmp_path / "r.yaml")
    assert load_ptq_recipe_file(tmp_path / "r.yaml") == recipe
    d = ptq_recipe_to_dict(recipe)
    assert d["default"] == {"name": "nvfp4-w4a4", "scale_rule": "4over6", "error": "maxabs", "act_scale_rule": "4over6"}
    assert d["rules"][1] == {"match": "re:\\.layers\\.0\\.mlp\\.", "scheme": "bf16"}  # all-default: the name alone
    assert d["kv_cache"] == {"format": "fp8-e4m3", "per_head": True}
    assert recipe.schemes()[0] == recipe.default and len(recipe.schemes()) == 8


def test_the_builtins():
    assert list_ptq_recipes() == sorted(BUILTINS)
    nv = get_ptq_recipe("nvfp4")
    assert (nv.default, nv.rules, nv.ignore, nv.kv_cache) == (Scheme("nvfp4-w4a16"), (), DEFAULT_EXCLUDE, None)
    mixed = get_ptq_recipe("nvfp4-experts-fp8-attention")
    assert mixed.default == Scheme("nvfp4-w4a4", "6", "mse", "6")
    assert mixed.rules == (PTQRule("attention", Scheme("fp8-w8a8", weights="tensor", activations="static")),)
    assert mixed.kv_cache == KVCacheScheme("fp8-e4m3", per_head=False) and mixed.ignore == DEFAULT_EXCLUDE
    for word in ("FP8 W8A8", "attention", "NVFP4 W4A4", "MLP", "KV cache", "ModelOpt", "write-up"):
        assert word in mixed.description, word
    assert get_ptq_recipe("fp8").default == Scheme("fp8-w8a8") and get_ptq_recipe("fp8").rules == ()
    assert get_ptq_recipe("mxfp4-w4a16").default == Scheme("mxfp4-w4a16")
    assert all(get_ptq_recipe(n).description for n in BUILTINS)
    assert mixed.needs_calibration and get_ptq_recipe("fp8").needs_calibration
    assert not nv.needs_calibration and not get_ptq_recipe("mxfp4-w4a16").needs_calibration
    with pytest.raises(UsageError, match="neither a built-in PTQ recipe"):
        get_ptq_recipe("nvfp5")


_GOOD = {"name": "r", "default": "nvfp4-w4a4", "rules": [{"match": "attention", "scheme": "fp8-w8a8"}],
         "kv_cache": {"format": "fp8-e4m3", "per_head": False}}


@pytest.mark.parametrize("where,edit,key,allowed", [
    ("top level", lambda d: d.update(exclude=["x"]), "exclude",
     "['name', 'description', 'default', 'rules', 'ignore', 'kv_cache']"),
    ("rule", lambda d: d["rules"][0].update(when="always"), "when", "['match', 'scheme']"),
    ("scheme", lambda d: d.update(default={"name": "nvfp4-w4a4", "outer": "row"}), "outer",
     "['name', 'scale_rule', 'error', 'act_scale_rule']"),
    ("rule scheme", lambda d: d["rules"][0].update(scheme={"name": "fp8-w8a8", "granularity": "tensor"}),
     "granularity", "['name', 'weights', 'activations']"),
    ("kv_cache", lambda d: d["kv_cache"].update(dtype="fp8"), "dtype", "['format', 'per_head']"),
])
def test_unknown_keys_are_refused_at_every_level(where, edit, key, allowed, tmp_path):
    assert ptq_recipe_from_dict(_GOOD).name == "r"
    d = yaml.safe_load(yaml.safe_dump(_GOOD))
    edit(d)
    with pytest.raises(UsageError) as exc:
        ptq_recipe_from_dict(d)
    assert f"unknown key(s) ['{key}']" in str(exc.value) and allowed in str(exc.value), str(exc.value)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(UsageError, match="r.yaml"):
        load_ptq_recipe_file(tmp_path / "r.yaml")


@pytest.mark.parametrize("edit,parts", [
    (lambda d: d.update(default="fp16"), ("default", "'fp16'", "'bf16'")),
    (lambda d: d.update(name=3), ("name=3",)),
    (lambda d: d.update(rules={"match": "attention"}), ("rules", "expected a list")),
    (lambda d: d["rules"][0].pop("scheme"), ("rules[0]", "missing 'scheme'")),
    (lambda d: d["rules"][0].update(match="re:("), ("re:(", "not a valid regular expression")),
    (lambda d: d["rules"][0].update(match=""), ("match=''", "attention")),
    (lambda d: d.update(ignore="lm_head"), ("ignore", "list of regular expressions")),
    (lambda d: d.update(ignore=["(lm_head"]), ("ignore", "(lm_head")),
    (lambda d: d["kv_cache"].update(format="fp8-e5m2"), ("kv_cache", "'fp8-e5m2'", "'fp8-e4m3'")),
    (lambda d: d["kv_cache"].update(per_head="yes"), ("kv_cache", "per_head='yes'")),
    (lambda d: d["rules"][0].update(scheme={"name": "fp8-w8a8", "weights": 8}), ("weights='8'", "'tensor'")),
])
def test_bad_values_name_the_field_and_the_allowed_values(edit, parts):
    d = yaml.safe_load(yaml.safe_dump(_GOOD))
    edit(d)
    with pytest.raises(UsageError) as exc:
        ptq_recipe_from_dict(d)
    for part in parts:
        assert part in str(exc.value), (part, str(exc.value))


def test_missing_keys_take_the_defaults_and_a_kv_cache_may_be_a_format_name():
    r = ptq_recipe_from_dict({"kv_cache": "fp8-e4m3"})
    assert r == PTQRecipe(kv_cache=KVCacheScheme())
    assert r.name == "custom" and r.default == Scheme("nvfp4-w4a16") and r.ignore == DEFAULT_EXCLUDE


def test_recipe_files_that_are_not_regular_yaml_files(tmp_path):
    with pytest.raises(UsageError, match="a directory"):
        load_ptq_recipe_file(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_ptq_recipe_file(tmp_path / "bad.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_ptq_recipe_file(tmp_path / "bin.yaml")
    (tmp_path / "list.yaml").write_text("- nvfp4\n")
    with pytest.raises(UsageError, match="expected a mapping"):
        load_ptq_recipe_file(tmp_path / "list.yaml")
    (tmp_path / "obj.yaml").write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(UsageError, match="not valid YAML"):  # the safe loader builds no objects
        load_ptq_recipe_file(tmp_path / "obj.yaml")


def test_with_nvfp4_sets_the_options_of_every_nvfp4_scheme_only():
    r = _every_feature_recipe().with_nvfp4(scale_rule="sweep", act_scale_rule="6")
    assert r.default == Scheme("nvfp4-w4a4", "sweep", "maxabs", "6")
    assert r.rules[6].scheme == Scheme("nvfp4-w4a16", "sweep")
    assert [x.scheme for x in r.rules[:6]] == [x.scheme for x in _every_feature_recipe().rules[:6]]
    assert (r.name, r.ignore, r.kv_cache) == ("every-feature", ("lm_head",), KVCacheScheme(per_head=True))
    mixed = get_ptq_recipe("nvfp4-experts-fp8-attention").with_nvfp4(error="mae", scale_rule="4over6")
    assert mixed.default == Scheme("nvfp4-w4a4", "4over6", "mae") and mixed.rules[0].scheme == Scheme("fp8-w8a8")
    assert mixed.with_nvfp4() == mixed
    with pytest.raises(UsageError, match="'fp8' has no NVFP4 scheme that takes scale_rule"):
        get_ptq_recipe("fp8").with_nvfp4(scale_rule="sweep")
    with pytest.raises(UsageError, match="'nvfp4' has no NVFP4 scheme that takes act_scale_rule"):
        get_ptq_recipe("nvfp4").with_nvfp4(act_scale_rule="4over6")


def test_single_and_recipe_validation():
    r = PTQRecipe.single(Scheme("fp8-w8a8"), ignore=("lm_head",))
    assert (r.default, r.rules, r.ignore, r.name) == (Scheme("fp8-w8a8"), (), ("lm_head",), "fp8-w8a8")
    assert PTQRecipe(default="mxfp8").default == Scheme("mxfp8")  # a name is converted
    assert PTQRule("mlp", "bf16").scheme == Scheme("bf16")
    with pytest.raises(UsageError, match=r"rules\[0\]"):
        PTQRecipe(rules=({"match": "mlp", "scheme": "bf16"},))
    with pytest.raises(UsageError, match="kv_cache"):
        PTQRecipe(kv_cache=True)
    with pytest.raises(UsageError, match="name"):
        PTQRecipe(name="")


# ----------------------------------------------------------------------------- assignment

@pytest.fixture(scope="module")
def llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]


def test_module_classes_of_a_llama(llama):
    for i in range(2):
        for leaf in ATTN:
            assert module_classes(llama, f"model.layers.{i}.self_attn.{leaf}") == {"attention"}
        for leaf in MLP:
            assert module_classes(llama, f"model.layers.{i}.mlp.{leaf}") == {"mlp"}
    assert module_classes(llama, "lm_head") == frozenset()


class _Experts(nn.ModuleList):
    pass


class ToySparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = _Experts([nn.ModuleDict({"w1": nn.Linear(8, 8), "w3": nn.Linear(8, 8)}) for _ in range(2)])
        self.shared_expert = nn.ModuleDict({"up_proj": nn.Linear(8, 8)})


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = nn.ModuleDict({"wq": nn.Linear(8, 8)})  # no class or path hint
        self.attention = nn.ModuleDict({"wq": nn.Linear(8, 8)})  # path hint .attention.
        self.ff = ToyFeedForward()
        self.moe = ToySparseMoeBlock()


class ToyFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 8)  # a "gate" that is no router: its parent is no MoE block


def test_module_classes_of_experts_shared_experts_and_routers():
    model = nn.ModuleDict({"layers": nn.ModuleList([ToyBlock()])})
    assert module_classes(model, "layers.0.mixer.wq") == frozenset()
    assert module_classes(model, "layers.0.attention.wq") == {"attention"}
    assert module_classes(model, "layers.0.ff.gate") == {"mlp"}
    assert module_classes(model, "layers.0.moe.gate") == {"router"}
    assert module_classes(model, "layers.0.moe.experts.1.w3") == {"experts"}
    assert module_classes(model, "layers.0.moe.shared_expert.up_proj") == {"shared_experts"}


def test_the_mixed_builtin_puts_fp8_on_attention_and_nvfp4_on_mlps(llama):
    names = _linears(llama)
    assign = assign_schemes(llama, names, get_ptq_recipe("nvfp4-experts-fp8-attention"))
    assert list(assign) == names
    for name, scheme in assign.items():
        want = Scheme("fp8-w8a8") if ".self_attn." in name else Scheme("nvfp4-w4a4")
        assert scheme == want, name
    assert describe_assignment(assign) == [
        "fp8-w8a8 (8 Linears): model.layers.*.self_attn.q_proj (2), model.layers.*.self_attn.k_proj (2), "
        "model.layers.*.self_attn.v_proj (2), model.layers.*.self_attn.o_proj (2)",
        "nvfp4-w4a4 (6 Linears): model.layers.*.mlp.gate_proj (2), model.layers.*.mlp.up_proj (2), "
        "model.layers.*.mlp.down_proj (2)"]
    assert describe_assignment({"a.0.b": "bf16"}) == ["bf16 (1 Linear): a.*.b"]
    assert fold_names(["m.layers.0.experts.3.w1", "m.layers.1.experts.0.w1"]) == ["m.layers.*.experts.*.w1 (2)"]


def test_globs_regexes_first_match_and_the_default(llama):
    names = _linears(llama)
    recipe = PTQRecipe(default=Scheme("mxfp4-w4a16"), rules=(
        PTQRule("model.layers.0.self_attn.*", Scheme("bf16")),            # glob: layer 0's attention
        PTQRule("re:\\.1\\.self_attn\\.", Scheme("fp8-w8a8", weights="channel")),  # regex: layer 1's
        PTQRule("attention", Scheme("fp8-block")),                       # never reached: both layers matched above
        PTQRule("*.down_proj", Scheme("mxfp8")),
        PTQRule("re:down_proj$", Scheme("nvfp4-w4a16")),                 # shadowed by the glob before it
        PTQRule("re:layers\\.1\\.mlp\\.(gate|up)_proj", Scheme("nvfp4-w4a4", "4over6")),
    ))
    assign = assign_schemes(llama, names, recipe)
    for leaf in ATTN:
        assert assign[f"model.layers.0.self_attn.{leaf}"] == Scheme("bf16")
        assert assign[f"model.layers.1.self_attn.{leaf}"] == Scheme("fp8-w8a8", weights="channel")
    for i in range(2):
        assert assign[f"model.layers.{i}.mlp.down_proj"] == Scheme("mxfp8")
    assert assign["model.layers.1.mlp.gate_proj"] == assign["model.layers.1.mlp.up_proj"] == \
        Scheme("nvfp4-w4a4", "4over6")
    assert assign["model.layers.0.mlp.gate_proj"] == assign["model.layers.0.mlp.up_proj"] == Scheme("mxfp4-w4a16")
    assert Scheme("fp8-block") not in assign.values()
    assert recipe.rule_for("model.layers.1.mlp.down_proj", {"mlp"}) == (3, Scheme("mxfp8"))
    assert recipe.rule_for("model.layers.0.mlp.up_proj", {"mlp"}) == (None, Scheme("mxfp4-w4a16"))
    # globs match the full name only: "down_proj" alone is no glob for "model.layers.0.mlp.down_proj"
    assert not PTQRule("down_proj", Scheme("bf16")).matches("model.layers.0.mlp.down_proj")
    assert PTQRule("re:down_proj", Scheme("bf16")).matches("model.layers.0.mlp.down_proj")


def test_ignore(llama):
    recipe = get_ptq_recipe("nvfp4-experts-fp8-attention")
    for name in ("lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.0.mlp.router"):
        assert recipe.is_ignored(name), name
    assert not any(recipe.is_ignored(n) for n in _linears(llama))
    assert PTQRecipe(ignore=("re_not_needed", "o_proj$")).is_ignored("model.layers.0.self_attn.o_proj")
    assert PTQConfig(exclude=("o_proj",)).ptq_recipe.ignore == ("o_proj",)


@pytest.mark.parametrize("pattern,first,other", [
    ("*.q_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"),
    ("re:layers\\.1\\..*v_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"),
    ("*.0.mlp.up_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
])
def test_a_rule_splitting_a_fused_group_is_refused_naming_both(llama, pattern, first, other):
    recipe = PTQRecipe(default=Scheme("nvfp4-w4a16"), rules=(PTQRule(pattern, Scheme("fp8-w8a8")),))
    with pytest.raises(QuantizationError) as exc:
        assign_schemes(llama, _linears(llama), recipe)
    msg = str(exc.value)
    assert first in msg and other in msg, msg
    assert "fp8-w8a8" in msg and "nvfp4-w4a16" in msg and repr(pattern) in msg and "the default" in msg
    assert "fused" in msg and "one scheme" in msg


def test_a_fused_group_under_one_rule_is_fine(llama):
    recipe = PTQRecipe(rules=(PTQRule("re:self_attn\\.[qkv]_proj$", Scheme("fp8-w8a8")),))
    assign = assign_schemes(llama, _linears(llama), recipe)
    assert assign["model.layers.0.self_attn.o_proj"] == Scheme("nvfp4-w4a16")
    assert {assign[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"} == {Scheme("fp8-w8a8")}
