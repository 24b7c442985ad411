"""Automatic mixed precision under a bits budget (issue 34, item 1): units (fused groups and experts modules as
one), stored bits per weight, the MILP against brute force, sensitivities (deterministic, bf16 zero, the output
estimator equal to the PTQ module's measured error, the Fisher estimator equal to an independent gradient),
budgets kept and monotone, "active" cost from routing counts, the YAML recipe reproducing the checkpoint, and
the command line."""
from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import blockscale as bs
from blockscale.errors import UsageError
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.auto_recipe import AutoRecipeConfig, auto_recipe, brute_force, find_units, solve, storable_schemes
from blockscale.ptq.auto_recipe.costs import bits_per_weight, cost_table, effective_bits, unit_weights
from blockscale.ptq.scheme_plan import assign_schemes
from blockscale.recipes.ptq_builtin import get_ptq_recipe
from blockscale.recipes.ptq_recipe import PTQRecipe, PTQRule, Scheme
from blockscale.recipes.ptq_serialize import ptq_recipe_from_dict, ptq_recipe_to_dict

transformers = pytest.importorskip("transformers")
from cli_runs import run_cli  # noqa: E402
from tiny_models import byte_llama_dir, checkpoint_tensors, tiny_hf_llama, token_ids  # noqa: E402
from tiny_moe import E, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

def _run(model, bits, **kw):
    return auto_recipe(model, token_ids(8, 32), AutoRecipeConfig(effective_bits=bits, **kw))


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# ----------------------------------------------------------------------------- units and costs

def test_units_group_fused_siblings_and_experts_and_leave_routers_out():
    llama, moe = tiny_hf_llama(), tiny_moe("mixtral")
    units = find_units(llama)
    assert [u.name for u in units[:4]] == ["model.layers.0.self_attn.{q_proj,k_proj,v_proj}",
                                           "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.{gate_proj,up_proj}",
                                           "model.layers.0.mlp.down_proj"]
    assert len(units) == 8 and sum(u.params for u in units) == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)
    for model, us in ((llama, units), (moe, find_units(moe))):
        names = _linears(model) + [n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
        for u in us:  # each unit's rule selects exactly its members
            assert [n for n in names if PTQRule(u.match, Scheme("bf16")).matches(n)] == list(u.members)
        assert not any("lm_head" in n or "embed" in n or n.endswith(".gate") for u in us for n in u.members)
    ex = [u for u in find_units(moe) if u.kind == "experts"]
    assert [u.members for u in ex] == [("model.layers.0.mlp.experts",), ("model.layers.1.mlp.experts",)]
    assert ex[0].experts == E and ex[0].params == moe.model.layers[0].mlp.experts.gate_up_proj.numel() * 3 // 2


def test_per_expert_linear_layout_is_one_unit():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(32, 4, bias=False)  # the router: ignored by default
            self.experts = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(32, 64), "w3": nn.Linear(32, 64),
                                                        "w2": nn.Linear(64, 32)}) for _ in range(4))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.ModuleDict({"q_proj": nn.Linear(32, 32), "k_proj": nn.Linear(32, 32),
                                       "v_proj": nn.Linear(32, 32)})
            self.block_sparse_moe = Block()

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])
    units = find_units(model)
    assert [u.kind for u in units] == ["linear", "expert-linears"] * 2
    u = units[1]
    assert u.experts == 4 and len(u.members) == 12 and u.params == 4 * 3 * 64 * 32
    assert u.match == r"re:^layers\.0\.block_sparse_moe\.experts\.\d+\.(w1|w3|w2)$"
    assert [n for n in _linears(model) if PTQRule(u.match, Scheme("bf16")).matches(n)] == list(u.members)


def test_bits_per_weight_count_every_stored_scale_as_the_export_does():
    from blockscale.export.export_plan import bits_per_weight as exported

    assert bits_per_weight(Scheme("nvfp4-w4a4"), 64, 128) == 4.5 + 32 / (64 * 128)
    assert bits_per_weight(Scheme("nvfp4-w4a16"), 64, 128) == 4.5 + 32 / (64 * 128)
    assert bits_per_weight(Scheme("mxfp8"), 64, 128) == 8.25
    assert bits_per_weight(Scheme("fp8-w8a8"), 64, 128) == 8 + 32 / (64 * 128)
    assert bits_per_weight(Scheme("fp8-w8a8", weights="channel"), 64, 128) == 8 + 32 / 128
    assert bits_per_weight(Scheme("bf16"), 64, 128) == 16
    for name in ("nvfp4-w4a4", "mxfp8", "fp8-w8a8"):  # the same count as a written checkpoint's report
        model = tiny_hf_llama()
        quantize_model(model, PTQConfig(recipe=PTQRecipe.single(Scheme(name))), token_ids(2, 16), progress=False)
        m = model.model.layers[0].mlp.down_proj
        assert exported({"d": m}) == round(bits_per_weight(Scheme(name), m.out_features, m.in_features), 4)


# ----------------------------------------------------------------------------- the solver

@pytest.mark.parametrize("seed", range(20))
def test_milp_equals_brute_force(seed):
    rng = random.Random(seed)
    U, K = rng.randint(2, 6), rng.randint(2, 5)
    scores = [[rng.random() * 10 ** rng.randint(-6, 0) for _ in range(K)] for _ in range(U)]
    costs = [[rng.uniform(0.1, 3.0) if k == 0 or rng.random() > 0.2 else math.inf for k in range(K)] for _ in range(U)]
    low = sum(min(c for c in row if c < math.inf) for row in costs)
    high = sum(max(c for c in row if c < math.inf) for row in costs)
    for budget in (low, low + (high - low) * rng.random(), low + (high - low) * rng.random(), high):
        a, b = solve(scores, costs, budget), brute_force(scores, costs, budget)
        assert a.objective == b.objective and a.cost <= budget + 1e-9 and b.cost <= budget + 1e-9
    with pytest.raises(ValueError, match="no assignment fits"):
        solve(scores, costs, low * 0.99 - 1e-6)
    with pytest.raises(ValueError, match="no assignment fits"):
        brute_force(scores, costs, low * 0.99 - 1e-6)


def test_auto_recipe_is_the_exact_optimum_of_its_own_instance():
    r = _run(tiny_moe("mixtral"), 6)
    weights = unit_weights(r.units, r.sensitivity.active_fraction, "total")
    costs = cost_table(r.units, r.config.candidates, weights, [[v is not None for v in row] for row in r.sensitivity.scores])
    scores = [[v if v is not None else 0.0 for v in row] for row in r.sensitivity.scores]
    best = brute_force(scores, costs, 6)  # 5^6 assignments
    assert r.objective == best.objective and r.effective_bits == best.cost


# ----------------------------------------------------------------------------- sensitivities

@pytest.mark.parametrize("estimator", ["fisher", "output"])
def test_scores_are_deterministic_and_bf16_scores_zero(estimator):
    model = tiny_moe("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a, b = _run(model, 6, estimator=estimator), _run(model, 6, estimator=estimator)
    assert a.sensitivity.scores == b.sensitivity.scores and a.recipe == b.recipe
    assert all(row[-1] == 0.0 and all(v > 0 for v in row[:-1]) for row in a.sensitivity.scores)
    after = model.state_dict()  # the model is left as it was (dtype, values, requires_grad, mode)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_a_bfloat16_model_is_measured_in_float32_and_given_back_unchanged():
    model = tiny_hf_llama().to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = _run(model, 6)
    want = _run(tiny_hf_llama().to(torch.bfloat16).float(), 6)  # the same weights, already float32
    assert r.sensitivity.scores == want.sensitivity.scores
    after = model.state_dict()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)


def _outputs(model, names, ids):
    seen = {n: [] for n in names}
    hs = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen[n].append(o.detach()))
          for n in names]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hs:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_output_scores_equal_the_error_of_the_modules_ptq_builds(family):
    """Layer 0's units see the same inputs in PTQ: the "output" score of each candidate is the mean squared output
    error of the module PTQ (RTN) builds for it, static activation scales included."""
    model = tiny_hf_llama() if family == "llama" else tiny_moe("mixtral")
    ids = token_ids(8, 32)
    r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=16, estimator="output"))
    for i, unit in enumerate(r.units[:3]):
        if not unit.name.startswith("model.layers.0."):
            continue
        ref = _outputs(model, unit.members, ids)
        for c, s in enumerate(r.config.candidates[:-1]):
            q = copy.deepcopy(model)
            recipe = PTQRecipe(default=Scheme("bf16"), rules=(PTQRule(unit.match, s),))
            quantize_model(q, PTQConfig(recipe=recipe, n_samples=8, seq_len=32), ids, progress=False)
            got = _outputs(q, unit.members, ids)
            err = sum(float((got[n] - ref[n]).double().square().sum()) for n in unit.members) / ids.numel()
            assert r.sensitivity.scores[i][c] == pytest.approx(err, rel=1e-4), (unit.name, s.name)


def test_fisher_score_equals_an_independent_gradient_computation():
    model, ids = tiny_hf_llama(), token_ids(4, 16)
    r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=16, candidates=("nvfp4-w4a16", "bf16"), batch_size=2))
    name = "model.layers.1.mlp.down_proj"
    i = next(k for k, u in enumerate(r.units) if u.members == (name,))
    w = model.get_submodule(name).weight.detach()
    dw = bs.quantize(w, bs.NVFP4()).dequantize(torch.float32) - w  # one Linear: RTN with its own outer scale
    want = 0.0
    for batch in ids.split(2):
        caught = {}

        def hook(m, a, o):
            o.retain_grad()
            caught["x"], caught["y"] = a[0].detach(), o

        h = model.get_submodule(name).register_forward_hook(hook)
        logits = model(input_ids=batch, use_cache=False).logits
        h.remove()
        F.cross_entropy(logits[:, :-1].reshape(-1, 96), batch[:, 1:].reshape(-1), reduction="sum").backward()
        want += 0.5 * float((caught["y"].grad * F.linear(caught["x"], dw)).double().square().sum())
    model.zero_grad()
    assert r.sensitivity.scores[i][0] == pytest.approx(want / (4 * 15), rel=1e-5)


# ----------------------------------------------------------------------------- budgets and costs

def test_budgets_are_kept_and_a_larger_one_never_scores_worse():
    model = tiny_hf_llama()
    units = find_units(model)
    last = math.inf
    for bits in (4.6, 5.0, 5.5, 6.0, 7.0, 8.0, 10.0, 12.0):
        r = _run(model, bits)
        schemes = [r.recipe.rule_for(u.members[0])[1] for u in units]
        achieved = effective_bits(units, schemes, [u.params for u in units])
        assert achieved == r.effective_bits == r.total_bits <= bits + 1e-9
        assert r.objective <= last
        last = r.objective
        assert not r.notes
    top = _run(model, 16)
    assert top.objective == 0.0 and {row.chosen for row in top.report} == {"bf16"} and "does not bind" in top.notes[0]
    with pytest.raises(UsageError, match=r"effective_bits=4 is below the cheapest assignment .*allowed: "
                                         r"effective_bits >= 4\.50"):
        _run(model, 4)


def test_active_cost_counts_routed_experts_by_their_routing_frequency():
    model, ids = tiny_moe("mixtral"), token_ids(8, 32)
    picked = {}

    def router_hook(i):
        return lambda m, a, o: picked.setdefault(i, []).append(o[2].reshape(-1))

    hs = [layer.mlp.gate.register_forward_hook(router_hook(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hs:
        h.remove()
    total = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6))
    active = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=6, cost="active"))
    assert total.sensitivity.scores == active.sensitivity.scores
    frac = []
    for u in active.units:
        if u.kind != "experts":
            frac.append(1.0)
            continue
        counts = torch.bincount(torch.cat(picked[int(u.members[0].split(".")[2])]), minlength=E).tolist()
        assert active.sensitivity.routed[u.name] == counts and sum(counts) == 2 * ids.numel()  # top-2
        frac.append(sum(counts) / (ids.numel() * E))
    assert active.sensitivity.active_fraction == frac and 0.5 in frac
    assert [row.counted for row in active.report] == [u.params * f for u, f in zip(active.units, frac)]
    for r in (total, active):  # each assignment counted both ways, independently
        schemes = [r.recipe.rule_for(u.members[0])[1] for u in r.units]
        assert r.total_bits == effective_bits(r.units, schemes, [u.params for u in r.units])
        assert r.active_bits == effective_bits(r.units, schemes, [u.params * f for u, f in zip(r.units, frac)])
        assert r.total_bits != r.active_bits  # experts and attention get different schemes here
    assert total.effective_bits == total.total_bits <= 6 and active.effective_bits == active.active_bits <= 6
    assert active.recipe.rules != total.recipe.rules
    dense = _run(tiny_hf_llama(), 6, cost="active")  # no experts: active = total
    assert dense.active_bits == dense.total_bits == dense.effective_bits


# ----------------------------------------------------------------------------- the recipe

@pytest.mark.parametrize("family,bits", [("llama", 5.5), ("mixtral", 6.5)])
def test_one_scheme_per_fused_group_and_experts_module_and_the_yaml_reproduces_the_checkpoint(tmp_path, family, bits):
    model = tiny_hf_llama() if family == "llama" else tiny_moe("mixtral")
    ids = token_ids(8, 32)
    r = auto_recipe(model, ids, AutoRecipeConfig(effective_bits=bits))
    assert len({row.chosen for row in r.report}) > 1  # a mix
    path = tmp_path / "auto.yaml"
    r.save(path)
    assert path.read_text() == r.yaml()
    back = get_ptq_recipe(path)
    assert back == r.recipe == ptq_recipe_from_dict(ptq_recipe_to_dict(r.recipe))
    names = [n for n in _linears(model) if not r.recipe.is_ignored(n)]
    assign = assign_schemes(model, names, back)  # (refuses a split fused group)
    for u, row in zip(r.units, r.report):
        for n in u.members:
            assert r.recipe.rule_for(n)[1].label == row.chosen
            if n in assign:
                assert assign[n].label == row.chosen
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    rep = quantize_model(a, PTQConfig(recipe=r.recipe, n_samples=8, seq_len=32), ids, progress=False)
    quantize_model(b, PTQConfig(recipe=back, n_samples=8, seq_len=32), ids, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    chosen = {n: row.chosen for u, row in zip(r.units, r.report) for n in u.members}
    assert all(lr.scheme == chosen[lr.name] for lr in rep.linears)
    assert all(e.scheme == chosen[e.name] for e in rep.experts)


def test_bad_arguments_are_usage_errors_naming_them():
    allowed = ", ".join(map(repr, storable_schemes()))
    assert storable_schemes() == ("nvfp4-w4a4", "nvfp4-w4a16", "fp8-w8a8", "mxfp8", "bf16")
    for kw, msg in [({"effective_bits": -1}, "effective_bits=-1: expected a finite number"),
                    ({"effective_bits": "6"}, "effective_bits='6'"), ({"effective_bits": math.nan}, "effective_bits=nan"),
                    ({"candidates": ("mxfp4",)}, f"candidates: mxfp4 cannot be a candidate.*allowed values: {allowed}"),
                    ({"candidates": "foo"}, "candidates: scheme 'foo' is not supported"),
                    ({"candidates": ()}, "candidates=\\(\\): expected a non-empty list"),
                    ({"candidates": "bf16,bf16"}, "candidates: bf16 is given twice"),
                    ({"estimator": "hessian"}, "estimator='hessian' is not supported; allowed values: 'fisher', 'output'"),
                    ({"cost": "all"}, "cost='all' is not supported; allowed values: 'total', 'active'"),
                    ({"seq_len": 1}, "seq_len=1"), ({"batch_size": 0}, "batch_size=0")]:
        with pytest.raises(UsageError, match=msg):
            AutoRecipeConfig(**{"effective_bits": 6, **kw})
    assert AutoRecipeConfig(6, candidates="mxfp8, bf16").labels == ("mxfp8", "bf16")
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=72, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(UsageError, match="none fits model.layers.0.mlp.down_proj .*not a multiple of 16"):
        _run(odd, 6, candidates=("nvfp4-w4a16",))


# ----------------------------------------------------------------------------- command line

@pytest.fixture
def byte_model(tmp_path):
    return byte_llama_dir(tmp_path)


@pytest.mark.parametrize("argv,line", [
    (["--auto-recipe"], "--auto-recipe needs --effective-bits B"),
    (["--effective-bits", "6"], "--effective-bits needs --auto-recipe"),
    (["--auto-recipe", "--effective-bits", "6", "--recipe", "fp8"], "--auto-recipe cannot be combined with --recipe"),
    (["--auto-recipe", "--effective-bits", "6", "--candidates", "mxfp4"], "--candidates: candidates: mxfp4 cannot"),
    (["--auto-recipe", "--effective-bits", "6", "--streaming"], "--streaming: --auto-recipe measures"),
    (["--auto-recipe", "--effective-bits", "6", "--candidates", "fp8-w8a8,bf16", "--scale-rule", "4over6"],
     "--scale-rule 4over6: no candidate takes it"),
])
def test_cli_errors_are_one_line(byte_model, tmp_path, capsys, argv, line):
    code, out, err = run_cli(["quantize", byte_model, "--out", tmp_path / "q", *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    assert "loading" not in out and not (tmp_path / "q").exists()


def test_cli_nvfp4_flags_set_the_nvfp4_candidates():
    from blockscale.cli.auto_recipe import auto_recipe_config
    from blockscale.cli.main import build_parser

    args = build_parser().parse_args(["quantize", "m", "--out", "o", "--auto-recipe", "--effective-bits", "5",
                                      "--scale-rule", "4over6", "--act-scale-rule", "4over6", "--exclude", "o_proj",
                                      "--auto-cost", "active", "--n-samples", "16"])
    config = auto_recipe_config(args)
    assert config.labels == ("nvfp4-w4a4 4over6-mse a:4over6", "nvfp4-w4a16 4over6-mse", "fp8-w8a8", "mxfp8", "bf16")
    assert config.cost == "active" and config.n_samples == 16 and config.ignore[-1] == "o_proj"


def test_cli_auto_recipe_end_to_end(byte_model, tmp_path, capsys):
    common = ["--calib", tmp_path / "cal.txt", "--n-samples", "4", "--seq-len", "32", "--batch-size", "2"]
    out = tmp_path / "q"
    code, stdout, err = run_cli(["quantize", byte_model, "--auto-recipe", "--effective-bits", "6", *common,
                                 "--out", out], capsys)
    assert code == 0, err
    assert "effective bits" in stdout and "of budget 6 (cost total" in stdout and "auto_recipe.yaml" in stdout
    recipe = get_ptq_recipe(out / "auto_recipe.yaml")
    report = json.loads((out / "ptq_report.json").read_text())["ptq"]["config"]
    assert ptq_recipe_from_dict(report["recipe"]) == recipe
    assert ptq_recipe_from_dict(report["auto_recipe"]["recipe"]) == recipe
    assert report["auto_recipe"]["effective_bits"] <= 6 and len(report["auto_recipe"]["units"]) == 8
    model = bs.load(out)
    with torch.no_grad():
        assert torch.isfinite(model(token_ids(1, 8, vocab=256)).logits).all()
    again = tmp_path / "again"  # the YAML with --recipe: the same checkpoint
    code, _, err = run_cli(["quantize", byte_model, "--recipe", out / "auto_recipe.yaml", *common, "--out", again],
                           capsys)
    assert code == 0, err
    got, want = checkpoint_tensors(again), checkpoint_tensors(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
