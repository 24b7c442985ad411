"""Issue 16: training recipes on gpt-oss experts (``bs.convert`` -> ``QuantizedGptOssExperts``).

transformers' GptOssExperts: gate_up_proj [E, H, 2I] transposed (x @ W), gate / up interleaved in the last dim,
gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H], a clamped GLU. convert keeps the very four
Parameters; a no-quantization recipe gives the HF logits bit for bit; NVFP4 equals a by-hand per-expert loop
(weights quantized as the out x in matrices gate_up_proj[e]^T [2I, H] / down_proj[e]^T [H, I], biases added in
high precision); backward and an optimizer step update the HF model's own Parameters.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import blockscale as bs
from blockscale.nn import QuantizedFusedExperts, QuantizedGptOssExperts, experts_only
from blockscale.recipes import LinearRecipe, Recipe

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, H, TOPK, tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FP32 = Recipe("fp32", LinearRecipe(unquantized_dtype="float32"))
BF16 = Recipe("bf16", LinearRecipe())  # bf16 operands, FP32 accumulation, no quantization
PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedGptOssExperts)}


def _routing(T, g, sentinel=False):
    idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    if sentinel:
        idx[3] = torch.tensor([E, 1])  # transformers' "no expert" index: skipped
    return idx, torch.softmax(torch.randn(T, TOPK, generator=g), -1)


@pytest.mark.parametrize("dtype,recipe", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_convert_without_quantization_equals_the_hf_forward(dtype, recipe):
    hf = tiny_gpt_oss().to(dtype)
    model = copy.deepcopy(hf)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    rep = bs.convert(model, recipe)
    ex = _experts(model)
    assert sorted(ex) == rep.experts == EXPERTS and not rep.unsupported  # gpt-oss was "unsupported" before
    assert all(rep.converted[n] == recipe.name for n in ex) and "and 2 fused experts modules converted" in str(rep)
    for n, m in ex.items():  # the very same four Parameter objects, under the same names
        assert all(getattr(m, k) is params[f"{n}.{k}"] for k in PARAMS)
        assert isinstance(m, QuantizedFusedExperts) and m.recipe == recipe.linear
    assert list(model.state_dict()) == keys and list(dict(model.named_parameters())) == list(params)
    x = token_ids(2, 16)
    # bit for bit: the same GEMMs on the same operands (F.linear on W[e]^T multiplies W[e] itself), bias added
    # after the GEMM as the HF loop does, then the HF combine (weight in the model dtype, index_add)
    want = logits(hf, x)
    assert torch.equal(logits(model, x), want)
    hf.set_experts_implementation("eager")  # the default is grouped_mm
    assert torch.equal(logits(model, x), logits(hf, x))
    # recipe=None (plain F.linear) too, on the module alone
    g = torch.Generator().manual_seed(1)
    hx = torch.randn(20, H, generator=g).to(dtype)
    idx, w = _routing(20, g)
    with torch.no_grad():
        for n in ex:
            plain = QuantizedGptOssExperts(hf.get_submodule(n))
            assert torch.equal(plain(hx, idx, w.to(dtype)), hf.get_submodule(n)(hx, idx, w.to(dtype)))
    again = bs.convert(model, "nvfp4-nvidia")  # converting again only changes the recipe
    assert _experts(model) == ex and again.experts == EXPERTS
    assert all(m.recipe == bs.get_recipe("nvfp4-nvidia").linear for m in ex.values())
    assert bs.unconvert(model) >= 2 and not _experts(model)
    back = model.get_submodule(EXPERTS[0])
    assert type(back) is type(hf.get_submodule(EXPERTS[0]))
    assert all(getattr(back, k) is params[f"{EXPERTS[0]}.{k}"] for k in PARAMS)


def _glu(h, alpha, limit):
    """By hand: gate = even columns, up = odd columns, clamped GLU."""
    gate, up = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _reference(ex, x, idx, w, r: LinearRecipe, weight_blocks_along="in"):
    """By hand: per expert, its inputs fake-quantized per r.fprop_input, its weights as the out x in matrices
    gate_up_proj[e]^T [2I, H] / down_proj[e]^T [H, I] per r.fprop_weight (blocks along the input dim; "out":
    the wrong way, blocks along the output dim, to show the test can tell), FP32 GEMMs, biases added in x's
    dtype after the GEMM, then weighted and index-added per token (experts in ascending order)."""
    def wq(m):  # m: [in, out] as stored
        if weight_blocks_along == "out":
            return bs.fake_quantize(m, r.fprop_weight, dtype=torch.float32)  # blocks along out
        return bs.fake_quantize(m.t().contiguous(), r.fprop_weight, dtype=torch.float32).t()

    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        order = torch.argsort(slot * x.shape[0] + tok)  # the HF loop's order: by top-k rank, then token
        tok, slot = tok[order], slot[order]
        if tok.numel() == 0:
            continue
        xq = bs.fake_quantize(x[tok], r.fprop_input, dtype=torch.float32)
        h = (xq @ wq(ex.gate_up_proj[e].detach())).to(x.dtype) + ex.gate_up_proj_bias[e].detach()
        hq = bs.fake_quantize(_glu(h, ex.alpha, ex.limit), r.fprop_input, dtype=torch.float32)
        y = (hq @ wq(ex.down_proj[e].detach())).to(x.dtype) + ex.down_proj_bias[e].detach()
        out.index_add_(0, tok, (y * w[tok, slot, None]).to(x.dtype))
    return out


def _nvfp4_1d():
    """nvfp4-nvidia with 1-D (1 x 16) weight blocks: which dim the weight is blocked along shows."""
    r = bs.get_recipe("nvfp4-nvidia")
    return r.with_(name="nvfp4-1d", linear=dataclasses.replace(
        r.linear, fprop_weight=dataclasses.replace(r.linear.fprop_weight, block_2d=False)))


@pytest.mark.parametrize("name", ["nvfp4-nvidia", "nvfp4-1d"])
def test_convert_nvfp4_equals_a_by_hand_per_expert_reference(name):
    model = tiny_gpt_oss()
    hf = copy.deepcopy(model)
    recipe = _nvfp4_1d() if name == "nvfp4-1d" else bs.get_recipe(name)
    rep = bs.convert(model, experts_only(recipe))
    assert rep.counts() == {f"{name}-experts": 2} and rep.experts == list(rep.converted) == EXPERTS
    m = model.model.layers[1].mlp.experts
    r = recipe.linear
    assert isinstance(m, QuantizedGptOssExperts) and m.recipe == r and r.quantized
    assert r.fprop_weight.block_2d == (name == "nvfp4-nvidia")  # 16 x 16 weight blocks: transpose-invariant
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, H, generator=g) * 2
    idx, w = _routing(24, g, sentinel=True)
    ex = hf.model.layers[1].mlp.experts
    with torch.no_grad():
        got = m(x, idx, w)
        assert torch.equal(got, _reference(ex, x, idx, w, r))
        if not r.fprop_weight.block_2d:  # 1 x 16 blocks along H (gate_up) / I (down), not along the stored rows
            assert not torch.equal(got, _reference(ex, x, idx, w, r, weight_blocks_along="out"))
        idx[3] = torch.tensor([0, 1])  # (GptOssExperts' one_hot refuses the sentinel)
        assert not torch.equal(m(x, idx, w), ex(x, idx, w))  # NVFP4 changed something
        assert torch.isfinite(logits(model, token_ids(2, 16))).all()


def test_convert_backward_and_an_optimizer_step_update_the_hf_parameters():
    model = tiny_gpt_oss().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made before convert: the Parameters stay the same
    keys = list(model.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    assert len(before) == 8
    rep = bs.convert(model, "nvfp4-nvidia")
    assert rep.experts == EXPERTS and rep.counts()["nvfp4-nvidia"] == 10  # 4 attention Linears per layer too
    assert list(model.state_dict()) == keys
    x = token_ids(4, 16)
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        if ".experts." in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert model.model.layers[0].mlp.router.weight.grad.abs().sum() > 0  # the router learns through the weights
    opt.step()
    for n, p in model.named_parameters():
        if n in before:
            assert not torch.equal(p.detach(), before[n]), n
    bs.unconvert(model)  # the HF modules with the updated Parameters
    hf_ex = model.model.layers[0].mlp.experts
    assert type(hf_ex).__name__ == "GptOssExperts" and list(model.state_dict()) == keys
    assert not torch.equal(hf_ex.gate_up_proj_bias.detach(), before["model.layers.0.mlp.experts.gate_up_proj_bias"])


def test_gradients_without_quantization_equal_the_hf_module_gradients():
    """recipe=None: the gradients of all four Parameters and of the inputs equal autograd through
    GptOssExperts.forward. Input and routing-weight gradients bit for bit; the Parameter gradients to FP32
    rounding (rtol 1e-5: the per-expert weight / bias gradient reductions run in another order, ~1e-7
    relative here)."""
    hf = tiny_gpt_oss().model.layers[0].mlp.experts
    q = QuantizedGptOssExperts(copy.deepcopy(hf))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, H, generator=g)
    idx, w = _routing(24, g)
    gout = torch.randn(24, H, generator=g)
    grads = []
    for mod in (hf, q):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        (mod(xa, idx, wa) * gout).sum().backward()
        grads.append((xa.grad, wa.grad, {k: getattr(mod, k).grad for k in PARAMS}))
    (xh, wh, ph), (xq, wq, pq) = grads
    assert torch.equal(xh, xq) and torch.equal(wh, wq)
    for k in PARAMS:
        assert pq[k].abs().sum() > 0
        torch.testing.assert_close(pq[k], ph[k], rtol=1e-5, atol=1e-5 * float(ph[k].abs().max()))
    # nothing routed (every slot on the sentinel): zeros, and zero gradients (not None) for the four Parameters
    q.zero_grad(set_to_none=True)
    y = q(x, torch.full_like(idx, E), w)
    assert torch.equal(y, torch.zeros_like(x))
    y.sum().backward()
    assert all(torch.equal(getattr(q, k).grad, torch.zeros_like(getattr(q, k))) for k in PARAMS)


def test_experts_only_converts_the_experts_and_leaves_attention_alone():
    model = tiny_gpt_oss()
    with torch.no_grad():  # a GptOssExperts of a layout QuantizedGptOssExperts does not know: reported, kept
        model.model.layers[0].mlp.experts.register_buffer("extra", torch.zeros(1))
    rep = bs.convert(model, experts_only("nvfp4-nvidia"))
    assert rep.counts() == {"nvfp4-nvidia-experts": 1} and rep.experts == [EXPERTS[1]]
    assert "buffers ['extra']" in rep.unsupported[EXPERTS[0]]
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    assert isinstance(model.model.layers[1].mlp.experts, QuantizedGptOssExperts)
    assert not any(isinstance(m, bs.QuantizedLinear) for m in model.modules())
    for i in range(2):
        attn = model.model.layers[i].self_attn
        assert all(type(getattr(attn, p)) is torch.nn.Linear for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert f"model.layers.{i}.self_attn.q_proj" in rep.excluded
