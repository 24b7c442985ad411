"""R3 (issue 33): queries and keys rotated after RoPE for the KV cache's key quantization
(``nn.kv_cache.attach_key_rotation``, ``PTQConfig(rotate="r3")``). Without KV scales it changes nothing (bit for
bit); with FP8 KV scales attention computes ``(q H) Q(K H)^T``, the explicit product an engine rotating both
computes; PTQ calibrates the key scales on ``K H``; the plan's grammar."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale.errors import QuantizationError, UsageError
from blockscale.nn.kv_cache import (attach_key_rotation, attention_modules, fp8_kv_fake_quantize, key_rotation,
                                    key_rotations, set_kv_scales)
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.rotations import RotationPlan, parse_rotate, rotate_model
from blockscale.quant.transforms.rotation import rotation
from blockscale.recipes import KVCacheScheme, get_ptq_recipe

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 16, seed=3)
CALIB = token_ids(8, 32, seed=0)


def _logits(model):
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


@pytest.mark.parametrize("text, want", [
    ("r3", RotationPlan(r3=True)), ("r1r2r3r4", RotationPlan(r1=True, r2=True, r3=True, r4=True)),
    ("r3+mr", RotationPlan(r3=True, inputs="group")), ("r1r2+r3", RotationPlan(r1=True, r2=True, r3=True))])
def test_parse_r3(text, want):
    plan = parse_rotate(text)
    assert plan == want and plan.online and parse_rotate(plan.label) == plan


@pytest.mark.parametrize("text", ["r3r3", "r3+r3", "r1r2+r2"])
def test_a_rotation_named_twice_is_refused(text):
    with pytest.raises(UsageError, match="names a rotation twice"):
        parse_rotate(text)


def test_r3_changes_nothing_without_kv_quantization():
    model = tiny_hf_llama()
    ref = _logits(model)
    rep = rotate_model(model, parse_rotate("r3"))
    assert set(key_rotations(model)) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert any("online R3: hadamard 16" in line and "2 attention module(s)" in line for line in rep.lines())
    assert torch.equal(_logits(model), ref)  # bit for bit: the rotation is only computed for a quantized cache


def _record_attention(model):
    """Switch ``model`` to an attention function (transformers' public ``AttentionInterface``) that records the
    query / key each layer's attention receives, then runs sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen, name = [], f"bs_recording_{id(model)}"

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((module.layer_idx, query.detach().clone(), key.detach().clone()))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, recording)  # (a global registry: one name per model)
    model.config._attn_implementation = name
    for m in model.modules():
        if hasattr(m, "config") and m.config is not model.config:
            m.config._attn_implementation = name
    return seen


def test_r3_with_fp8_kv_is_the_explicit_rotated_product():
    """Attention gets K^ = Q(K H) H^T, so q K^^T = (q H) Q(K H)^T: what an engine rotating queries and keys
    after RoPE and quantizing the rotated keys computes."""
    plain, rotated = tiny_hf_llama(), tiny_hf_llama()
    seen_plain, seen_rot = _record_attention(plain), _record_attention(rotated)
    rotate_model(rotated, parse_rotate("r3"))
    scale = torch.tensor([0.004])
    for m in (plain, rotated):
        for attn in attention_modules(m).values():
            set_kv_scales(attn, scale, torch.tensor([0.01]))
    with torch.no_grad():
        plain(IDS, use_cache=False)  # layer 0 is compared below: the same inputs in every copy
        rotated(IDS, use_cache=False)
        h = rotation("hadamard", 16)
        # layer 0's unquantized post-RoPE K: recover it from an unscaled run of a third copy
        raw = tiny_hf_llama()
        seen_raw = _record_attention(raw)
        raw(IDS, use_cache=False)
    (_, q, k), (_, q_r, k_hat) = seen_raw[0], seen_rot[0]
    assert torch.equal(q_r, q)  # the query reaches attention unrotated: the rotation lives in the key's quantizer
    want = h.unapply(fp8_kv_fake_quantize(h.apply(k), scale))
    assert torch.equal(k_hat, want)
    def rep(t):  # grouped-query attention: each KV head serves 2 query heads (transformers' repeat_kv)
        return t.repeat_interleave(2, dim=1)
    explicit = h.apply(q) @ rep(fp8_kv_fake_quantize(h.apply(k), scale)).transpose(-1, -2)
    assert torch.allclose(q_r @ rep(k_hat).transpose(-1, -2), explicit, rtol=1e-5, atol=1e-6)
    assert not torch.equal(seen_plain[0][2], k_hat)  # and not what quantizing K itself gives


def test_ptq_calibrates_key_scales_on_rotated_keys():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    recipe = get_ptq_recipe("nvfp4-experts-fp8-attention").replace(kv_cache=KVCacheScheme())
    model = tiny_hf_llama()
    rep = quantize_model(model, PTQConfig(recipe=recipe, rotate="r3", batch_size=8), CALIB, progress=False)
    assert any("online R3" in line for line in rep.rotation)
    h = rotation("hadamard", 16)
    with torch.no_grad():
        out = model(input_ids=CALIB, use_cache=False, output_hidden_states=True)
        pos_emb = model.model.rotary_emb(out.hidden_states[0], torch.arange(CALIB.shape[1])[None])
        for i, layer in enumerate(model.model.layers):
            attn, x = layer.self_attn, layer.input_layernorm(out.hidden_states[i])
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            _, k = apply_rotary_pos_emb(q, k, *pos_emb)
            assert torch.equal(attn.k_scale, h.apply(k).abs().max().reshape(1) / 448)
            assert key_rotation(attn) is not None


def test_r3_without_a_kv_cache_warns_once():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = quantize_model(tiny_hf_llama(), PTQConfig(rotate="r3"), CALIB, progress=False)
    lines = [str(w.message) for w in caught if "R3" in str(w.message)]
    assert len(lines) == 1 and "this recipe has no kv_cache: it changes nothing" in lines[0]
    assert rep.warnings.count(lines[0]) == 1


def test_r3_refusals():
    model = tiny_hf_llama()
    rotate_model(model, parse_rotate("r3"))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError, match="already has a key rotation"):
        rotate_model(model, parse_rotate("r3+mr"), {})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # checked before any change
    attn = model.model.layers[0].self_attn
    with pytest.raises(UsageError, match="already has a key rotation"):
        attach_key_rotation(attn, rotation("hadamard", 16))
    fresh = tiny_hf_llama().model.layers[0].self_attn
    with pytest.raises(ValueError, match="not a multiple of the rotation's block size 32"):
        attach_key_rotation(fresh, rotation("hadamard", 32))
