"""The torchtitan model converter (``blockscale.train.torchtitan``).

Without torchtitan: the conversion rules on torchtitan's module names and the routed-experts math
(``grouped_swiglu`` == ``bs.nn.moe.GroupedExperts`` with the recipe, bit for bit). With torchtitan 0.3
importable (it is not a project dependency: see docs/moe.md "torchtitan" for the throwaway venv these
ran in): the converter on torchtitan's own Llama3 and Qwen3-MoE configs (which modules, forward equal to
``bs.convert`` on the same modules) and a few CPU training steps.
"""
from __future__ import annotations

import pytest
import torch

from blockscale.nn.moe import GroupedExperts
from blockscale.recipes import get_recipe
from blockscale.train.torchtitan import conversion_plan, grouped_swiglu, torchtitan_available

pytestmark = pytest.mark.usefixtures("one_thread")
needs_torchtitan = pytest.mark.skipif(not torchtitan_available(), reason="torchtitan is not installed (not a project "
                                      "dependency; docs/moe.md 'torchtitan' says how these tests were run)")

# torchtitan 0.3's module names: Llama3 (fused qkv) and Qwen3-MoE blocks
LLAMA = ["lm_head"] + [f"layers.{i}.{n}" for i in range(6) for n in
                       ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                        "feed_forward.w3")]
MOE_LINEARS = ["lm_head"] + [f"layers.{i}.{n}" for i in range(4) for n in
                             ("attention.qkv_linear.wqkv", "attention.wo", "moe.router.gate", "moe.shared_experts.w1")]
MOE_EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(4)]


def test_conversion_plan_follows_the_recipe_rules_on_torchtitan_names():
    plan = conversion_plan(LLAMA, [], 6, "nvfp4-nvidia")  # its last 15% of blocks (1 of 6) in bf16
    assert "lm_head" not in plan and len(plan) == 30
    assert {f for f, r in plan.items() if r.name == "bf16"} == {f for f in LLAMA if f.startswith("layers.5.")}
    assert plan["layers.4.attention.wo"].name == "nvfp4-nvidia"
    plan = conversion_plan(LLAMA, [], 6, "mxfp8")
    assert len(plan) == 30 and {r.name for r in plan.values()} == {"mxfp8"}
    plan = conversion_plan(MOE_LINEARS, MOE_EXPERTS, 4, "nvfp4-nvidia")
    assert not any("router" in f for f in plan) and set(MOE_EXPERTS) <= set(plan)
    assert "layers.0.moe.shared_experts.w1" in plan
    plan = conversion_plan(MOE_LINEARS, MOE_EXPERTS, 4, "nvfp4-nvidia", experts_only=True)
    assert set(plan) == set(MOE_EXPERTS)
    plan = conversion_plan(LLAMA, [], 6, "nvfp4-nvidia", filter_fqns=["wqkv"])
    assert not any("wqkv" in f for f in plan) and "layers.0.attention.wo" in plan


@pytest.mark.parametrize("recipe", ["nvfp4-nvidia", "mxfp8"])
def test_grouped_swiglu_equals_blockscale_grouped_experts(recipe):
    """torchtitan's experts layout (w1_EFD, w2_EDF, w3_EFD: ours) through ``grouped_swiglu`` equals
    ``bs.nn.moe.GroupedExperts`` with the recipe, outputs and gradients bit for bit; an expert without
    tokens gets a zero gradient; padding rows give zeros."""
    torch.manual_seed(0)
    ref = GroupedExperts(4, 64, 96, get_recipe(recipe).linear)
    x = torch.randn(20, 64, requires_grad=True)
    counts = torch.tensor([5, 0, 9, 6])
    want = ref(x, counts)
    torch.manual_seed(7)  # the recipe's stochastic rounding of gradients draws from the global RNG
    want.square().sum().backward()
    w = {n: p.detach().clone().requires_grad_(True) for n, p in (("w1", ref.w1), ("w2", ref.w2), ("w3", ref.w3))}
    x2 = x.detach().clone().requires_grad_(True)
    got = grouped_swiglu(x2, counts, w["w1"], w["w2"], w["w3"], get_recipe(recipe).linear)
    torch.manual_seed(7)
    got.square().sum().backward()
    assert torch.equal(got, want) and torch.equal(x2.grad, x.grad)
    for n in ("w1", "w2", "w3"):
        assert torch.equal(w[n].grad, getattr(ref, n).grad), n
    assert torch.equal(w["w1"].grad[1], torch.zeros(96, 64))
    padded = grouped_swiglu(torch.cat([x.detach(), torch.ones(3, 64)]), counts, w["w1"], w["w2"], w["w3"],
                            get_recipe(recipe).linear)
    assert torch.equal(padded[:20], want.detach()) and torch.equal(padded[20:], torch.zeros(3, 64))


# ----------------------------------------------------------------------------- with torchtitan

def _tiny_llama3():
    """A 2-block torchtitan Llama3 (its own builders, the debug model's structure, dim 64), causal SDPA
    attention (FlexAttention has no backward on CPU)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT

    dim = 64
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=128,
        tok_embeddings=Embedding.Config(num_embeddings=128, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=128, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, hidden_dim=128,
                                    rope=ComplexRoPE.Config(dim=16, max_seq_len=64, theta=500000, scaling="llama"),
                                    attn_backend="flex"))
    return _sdpa(cfg)


def _tiny_qwen3_moe():
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm

    dim = 64
    cfg = Qwen3Model.Config(
        vocab_size=128, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=128, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=128, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=16,
                                       moe_hidden_dim=64, num_experts=4, top_k=2, attn_backend="flex",
                                       rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0),
                                       moe_comm_backend="standard"))
    return _sdpa(cfg)


def _sdpa(cfg):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


def _build(cfg, seed=0):
    torch.manual_seed(seed)
    m = cfg.build()
    m.init_states()
    return m


def _converter(recipe="nvfp4-nvidia", experts_only=False):
    from blockscale.train.torchtitan import blockscale_converter_config

    return blockscale_converter_config(recipe, experts_only=experts_only).build()


@needs_torchtitan
def test_llama3_converter_forward_equals_bs_convert():
    """The converted config builds a model that passes torchtitan's Module-protocol check; every block
    Linear (not lm_head) is a BlockscaleLinear; with the same weights its logits equal the stock model
    after ``bs.convert`` (which swaps torchtitan's Linear, an nn.Linear, for QuantizedLinear) bit for bit."""
    import blockscale as bs
    from blockscale.train.torchtitan import torchtitan_classes

    conv = _converter()
    model = _build(conv.convert(_tiny_llama3()))
    model.verify_module_protocol()
    linear_cls = torchtitan_classes()[1]
    names = {n for n, m in model.named_modules() if isinstance(m, linear_cls)}
    assert len(names) == 10 and "lm_head" not in names and set(conv.report) == names
    stock = _build(_tiny_llama3())
    stock.load_state_dict(model.state_dict())
    report = bs.convert(stock, "nvfp4-nvidia")
    assert set(report.converted) == names
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens), stock(tokens))
    plain = _build(_tiny_llama3())
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.equal(model(tokens), plain(tokens))  # the recipe is really applied


@needs_torchtitan
@pytest.mark.parametrize("experts_only", [False, True])
def test_qwen3_moe_converter(experts_only):
    """Qwen3-MoE: routed experts become Blockscale<GroupedExperts> (same parameter names), the routers stay;
    experts_only leaves every Linear. The experts' forward equals bs.nn.moe.GroupedExperts with the
    recipe on the same weights, bit for bit."""
    from torchtitan.models.common.moe import GroupedExperts as TTExperts

    conv = _converter(experts_only=experts_only)
    model = _build(conv.convert(_tiny_qwen3_moe()))
    model.verify_module_protocol()
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TTExperts)}
    assert len(experts) == 2 and all(type(m).__name__ == "BlockscaleGroupedExperts" for m in experts.values())
    assert not any("router" in n for n in conv.report)
    assert (set(conv.report) == set(experts)) == experts_only
    stock = _build(_tiny_qwen3_moe())
    assert set(stock.state_dict()) == set(model.state_dict())
    name, m = next(iter(experts.items()))
    ref = GroupedExperts(4, 64, 64, get_recipe("nvfp4-nvidia").linear)
    with torch.no_grad():
        ref.w1.copy_(m.w1_EFD), ref.w2.copy_(m.w2_EDF), ref.w3.copy_(m.w3_EFD)
        x, counts = torch.randn(12, 64), torch.tensor([3, 4, 0, 5])
        assert torch.equal(m(x, counts), ref(x, counts))


@needs_torchtitan
@pytest.mark.parametrize("which", ["llama3", "qwen3_moe"])
def test_a_few_training_steps_on_cpu(which):
    """4 AdamW steps of the converted tiny model on a repeated batch (CPU, one gloo process): the loss
    falls, every parameter (the experts too) gets a finite gradient, and the converter's
    post_optimizer_hook runs (a no-op: nothing is cached between steps)."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        conv = _converter()
        model = _build(conv.convert(_tiny_llama3() if which == "llama3" else _tiny_qwen3_moe()))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(2))
        losses = []
        for _ in range(4):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 128), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
            conv.post_optimizer_hook(model)
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.05, losses
    finally:
        if owns:
            dist.destroy_process_group()


@needs_torchtitan
def test_config_functions_for_the_torchtitan_command_line(monkeypatch):
    pytest.importorskip("tensorboard")  # torchtitan's config_registry modules import it
    from torchtitan.models.common import Linear
    from torchtitan.models.common.moe import GroupedExperts as TTExperts

    from blockscale.train import torchtitan as btt

    monkeypatch.setenv("BLOCKSCALE_RECIPE", "mxfp8")
    cfg = btt.llama3_debugmodel_blockscale()
    kinds = {f: type(c).__qualname__ for f, c, *_ in cfg.model_spec.model.traverse(Linear.Config)}
    assert kinds["lm_head"] == "Linear.Config" and kinds["layers.0.attention.wo"].endswith("BlockscaleLinear.Config")
    assert cfg.model_spec.model.layers[0].attention.wo.recipe_name == "mxfp8"
    monkeypatch.setenv("BLOCKSCALE_EXPERTS_ONLY", "1")
    cfg = btt.qwen3_debugmodel_moe_blockscale()
    ex = [c for _, c, *_ in cfg.model_spec.model.traverse(TTExperts.Config)]
    assert ex and all(c.recipe_name == "mxfp8" for c in ex)
    assert not any(hasattr(c, "recipe_name") for _, c, *_ in cfg.model_spec.model.traverse(Linear.Config))
