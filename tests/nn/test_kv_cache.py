"""FP8 KV cache (blockscale.nn.kv_cache) on tiny transformers Llama models (eager and sdpa): the K/V
the attention function receives are the post-RoPE K/V fake-quantized with the module's scales, the
real DynamicCache stores them during generation, observed amaxes are the true post-RoPE maxima, the
backward is straight through."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama import modeling_llama

from blockscale.errors import UsageError
from blockscale.nn import (attention_modules, fp8_kv_fake_quantize, kv_scale_from_amax, kv_scales, observe_kv,
                           remove_kv_quantization, set_kv_scales)

IMPLS = ("eager", "sdpa")
H_KV, HEAD_DIM = 2, 16


def _model(impl: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=H_KV, attn_implementation=impl)
    return LlamaForCausalLM(cfg).eval()


def _ids(seed: int = 1, b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _ref_fake_quant(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent reference: torch's own E4M3 RNE cast of clamp(t / s), times s (per layer or per head)."""
    s = s.float().reshape(1, -1, 1, 1) if s.numel() > 1 else s.float().reshape(())
    return ((t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(t.dtype)


@pytest.fixture
def capture(monkeypatch):
    """Switch a model to an attention function that records the (layer_idx, K, V) it receives, then
    runs the real eager / sdpa implementation (with its own mask)."""
    seen: list = []

    def install(model, impl):
        real = modeling_llama.eager_attention_forward if impl == "eager" else AttentionInterface._global_mapping["sdpa"]

        def attend(module, q, k, v, mask, **kw):
            seen.append((module.layer_idx, k.detach().clone(), v.detach().clone()))
            return real(module, q, k, v, mask, **kw)

        name = f"blockscale_test_capture_{impl}"
        monkeypatch.setitem(AttentionInterface._global_mapping, name, attend)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, name, AttentionMaskInterface._global_mapping[impl])
        model.set_attn_implementation(name)
        return seen

    return install


def _post_rope_kv(model):
    """Hooks computing every attention module's post-RoPE K / V independently (k_proj / v_proj outputs,
    transformers' apply_rotary_pos_emb on the position embeddings the module receives)."""
    out: dict = {}
    handles = []
    for name, attn in attention_modules(model).items():
        def hook(mod, args, kwargs, name=name):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            shape = (*h.shape[:-1], -1, mod.head_dim)
            with torch.no_grad():
                q = mod.q_proj(h).view(shape).transpose(1, 2)
                k = mod.k_proj(h).view(shape).transpose(1, 2)
                v = mod.v_proj(h).view(shape).transpose(1, 2)
                _, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
            out.setdefault(name, []).append((k, v))
        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    return out, handles


def _calibrated_scales(model, ids, per_head: bool, factor: float = 1.0):
    attns = attention_modules(model)
    with torch.no_grad(), observe_kv(attns, per_head=per_head) as obs:
        model(ids, use_cache=False)
    return {n: (k * factor, v * factor) for n, (k, v) in obs.scales().items()}


# -- numerics -----------------------------------------------------------------------------------
def test_fake_quantize_matches_torch_reference_per_layer_and_per_head():
    t = torch.randn(2, H_KV, 5, HEAD_DIM, generator=torch.Generator().manual_seed(0)) * 3
    for s in (torch.tensor([0.004]), torch.tensor([0.002, 0.03])):   # small scales: many values clamp
        assert torch.equal(fp8_kv_fake_quantize(t, s), _ref_fake_quant(t, s))
    tb = t.to(torch.bfloat16)
    out = fp8_kv_fake_quantize(tb, torch.tensor([0.01]))
    assert out.dtype == torch.bfloat16 and torch.equal(out, _ref_fake_quant(tb, torch.tensor([0.01])))
    with pytest.raises(UsageError, match="KV scale of shape"):
        fp8_kv_fake_quantize(t, torch.ones(3))


@pytest.mark.parametrize("scale", [torch.tensor([0.003]), torch.tensor([0.003, 0.05])])
def test_backward_is_straight_through(scale):
    t = torch.randn(2, H_KV, 4, HEAD_DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(t.shape, generator=torch.Generator().manual_seed(2))
    (fp8_kv_fake_quantize(t, scale) * g).sum().backward()
    assert torch.equal(t.grad, g)


def test_kv_scale_from_amax():
    amax = torch.tensor([0.0, 448.0, 3.5])
    assert torch.equal(kv_scale_from_amax(amax), torch.tensor([1.0, 1.0, 3.5 / 448]))


# -- the hook in a model ------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("per_head", [False, True])
def test_attention_receives_fake_quantized_post_rope_kv(impl, per_head, capture):
    model = _model(impl)
    ids = _ids()
    attns = attention_modules(model)
    assert list(attns) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    scales = _calibrated_scales(model, ids, per_head, factor=0.25)   # a quarter of amax/448: clamping too
    for name, (k, v) in scales.items():
        set_kv_scales(attns[name], k, v)
        assert kv_scales(attns[name])[0].shape == ((H_KV,) if per_head else (1,))
    seen = capture(model, impl)
    ref, handles = _post_rope_kv(model)
    with torch.no_grad():
        model(_ids(seed=3), use_cache=False)
    for h in handles:
        h.remove()
    assert [layer for layer, _, _ in seen] == [0, 1]
    for (layer, k_seen, v_seen), (name, attn) in zip(seen, attns.items()):
        (k_ref, v_ref), = ref[name]
        ks, vs = kv_scales(attn)
        assert torch.equal(k_seen, fp8_kv_fake_quantize(k_ref, ks)) and torch.equal(k_seen, _ref_fake_quant(k_ref, ks))
        assert torch.equal(v_seen, fp8_kv_fake_quantize(v_ref, vs)) and torch.equal(v_seen, _ref_fake_quant(v_ref, vs))
        assert not torch.equal(k_seen, k_ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_change_with_small_scales_and_recover_after_remove(impl):
    model = _model(impl)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        attns = attention_modules(model)
        for name, (k, v) in _calibrated_scales(model, ids, per_head=False, factor=0.1).items():
            set_kv_scales(attns[name], k, v)
        quant = model(ids, use_cache=False).logits
        assert not torch.equal(quant, ref)
        assert "model.layers.0.self_attn.k_scale" in model.state_dict()
        assert "model.layers.1.self_attn.v_scale" in model.state_dict()
        clone = copy.deepcopy(model)   # the hook and the scales travel with the module
        assert torch.equal(clone(ids, use_cache=False).logits, quant)
        for attn in attns.values():
            remove_kv_quantization(attn)
            assert kv_scales(attn) is None
        assert torch.equal(model(ids, use_cache=False).logits, ref)
        assert "model.layers.0.self_attn.k_scale" not in model.state_dict()


@pytest.mark.parametrize("per_head", [False, True])
def test_observed_amax_is_post_rope_max(per_head):
    model = _model("sdpa")
    attns = attention_modules(model)
    ref, handles = _post_rope_kv(model)
    with torch.no_grad(), observe_kv(attns, per_head=per_head) as obs:
        model(_ids(seed=1), use_cache=False)
        model(_ids(seed=2, t=5), use_cache=False)   # a running max over batches
    for h in handles:
        h.remove()
    dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
    for name in attns:
        k_amax = torch.stack([k.abs().amax(dim=dims) for k, _ in ref[name]]).amax(dim=0).reshape(-1)
        v_amax = torch.stack([v.abs().amax(dim=dims) for _, v in ref[name]]).amax(dim=0).reshape(-1)
        got_k, got_v = obs.amax[name]
        assert torch.equal(got_k, k_amax) and torch.equal(got_v, v_amax)
        assert got_k.shape == ((H_KV,) if per_head else (1,))
        assert torch.equal(obs.scales()[name][0], k_amax / 448)
    # after the block the observer records nothing more
    before = {name: tuple(t.clone() for t in pair) for name, pair in obs.amax.items()}
    with torch.no_grad():
        model(_ids(seed=4), use_cache=False)
    assert all(torch.equal(obs.amax[n][0], before[n][0]) and torch.equal(obs.amax[n][1], before[n][1]) for n in attns)


def test_observer_sees_unquantized_kv_of_a_quantized_layer():
    model = _model("eager")
    ids = _ids()
    attns = attention_modules(model)
    with torch.no_grad(), observe_kv(attns) as plain:
        model(ids, use_cache=False)
    for name, (k, v) in _calibrated_scales(model, ids, per_head=False, factor=0.1).items():
        set_kv_scales(attns[name], k, v)
    with torch.no_grad(), observe_kv(attns) as quantized:
        model(ids, use_cache=False)
    name0 = "model.layers.0.self_attn"   # layer 0's input does not depend on any KV quantization
    assert torch.equal(plain.amax[name0][0], quantized.amax[name0][0])


@pytest.mark.parametrize("impl", IMPLS)
def test_generation_cache_holds_fake_quantized_kv(impl, capture):
    model = _model(impl)
    ids = _ids(b=1, t=6)
    attns = attention_modules(model)
    for name, (k, v) in _calibrated_scales(model, ids, per_head=True, factor=0.5).items():
        set_kv_scales(attns[name], k, v)
    seen = capture(model, impl)
    ref, handles = _post_rope_kv(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        model(nxt, cache=cache, use_cache=True)
    for h in handles:
        h.remove()
    for i, (name, attn) in enumerate(attns.items()):
        ks, vs = kv_scales(attn)
        k_all = torch.cat([fp8_kv_fake_quantize(k, ks) for k, _ in ref[name]], dim=2)
        v_all = torch.cat([fp8_kv_fake_quantize(v, vs) for _, v in ref[name]], dim=2)
        assert torch.equal(cache.layers[i].keys, k_all) and torch.equal(cache.layers[i].values, v_all)
        # the decode step's attention saw the whole (quantized) cache
        _, k_seen, v_seen = [s for s in seen if s[0] == i][-1]
        assert k_seen.shape[2] == ids.shape[1] + 1
        assert torch.equal(k_seen, k_all) and torch.equal(v_seen, v_all)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True, pad_token_id=0)
    assert gen.shape == (1, ids.shape[1] + 3)


def test_gradients_flow_through_quantized_attention():
    model = _model("sdpa")
    ids = _ids()
    attns = attention_modules(model)
    for name, (k, v) in _calibrated_scales(model, ids, per_head=False, factor=0.5).items():
        set_kv_scales(attns[name], k, v)
    model.train()
    model(ids, use_cache=False).logits.square().mean().backward()
    g = model.model.layers[0].self_attn.k_proj.weight.grad
    assert g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)


def test_set_kv_scales_validates():
    model = _model("eager")
    attn = attention_modules(model)["model.layers.0.self_attn"]
    with pytest.raises(UsageError, match="k_scale has shape"):
        set_kv_scales(attn, torch.ones(3), torch.ones(1))
    with pytest.raises(UsageError, match="v_scale"):
        set_kv_scales(attn, torch.ones(1), torch.tensor([0.0]))
    with pytest.raises(UsageError, match="one granularity"):
        set_kv_scales(attn, torch.ones(1), torch.ones(H_KV))
    with pytest.raises(UsageError, match="cache"):
        set_kv_scales(torch.nn.Linear(2, 2), torch.ones(1), torch.ones(1))
    set_kv_scales(attn, torch.tensor([0.5], dtype=torch.float64), torch.tensor(0.25))
    k, v = kv_scales(attn)
    assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == (1,)
    set_kv_scales(attn, torch.full((H_KV,), 0.5), torch.full((H_KV,), 0.5))   # overwrite, per head
    assert kv_scales(attn)[0].shape == (H_KV,)


class _ToyAttention(torch.nn.Module):
    """A minimal attention module taking its cache positionally (K/V [B, H_kv, T, D], no RoPE)."""

    layer_idx, head_dim = 0, HEAD_DIM

    def __init__(self):
        super().__init__()
        self.k_proj = torch.nn.Linear(8, H_KV * HEAD_DIM)
        self.v_proj = torch.nn.Linear(8, H_KV * HEAD_DIM)

    def forward(self, h, cache=None):
        k = self.k_proj(h).view(*h.shape[:-1], H_KV, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(h).view(*h.shape[:-1], H_KV, HEAD_DIM).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return k, v


class _ListCache:
    def __init__(self):
        self.seen = []

    def update(self, k, v, layer_idx):
        self.seen.append((k, v, layer_idx))
        return k, v


def test_positional_cache_argument_and_real_cache():
    torch.manual_seed(0)
    attn = _ToyAttention()
    h = torch.randn(2, 3, 8)
    ks, vs = torch.tensor([0.002, 0.004]), torch.tensor([0.003, 0.001])
    with torch.no_grad():
        k0, v0 = attn(h)
        set_kv_scales(attn, ks, vs)
        real = _ListCache()
        for args in ((h,), (h, None), (h, real)):
            k, v = attn(*args)
            assert torch.equal(k, _ref_fake_quant(k0, ks)) and torch.equal(v, _ref_fake_quant(v0, vs))
        k, v = attn(h, cache=real)
        assert len(real.seen) == 2 and all(torch.equal(s[0], k) and s[2] == 0 for s in real.seen)
