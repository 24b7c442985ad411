"""NVFP4 KV cache (issue 34 item 2): the engines' numerics (TensorRT-LLM / vLLM / FlashInfer: per-layer scale
s = amax / 448, outer encode scale 1 / s, an E4M3 scale per 16 along head_dim) against the scalar NVFP4 reference;
attention receiving NVFP4 K / V; PTQ calibration; both checkpoint formats (ModelOpt ``kv_cache_quant_algo:
"NVFP4"``, compressed-tensors' tensor_group ``kv_cache_scheme``) exported and reloaded bit for bit; R3 with it; the
refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from blockscale.errors import UsageError
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.export.common import CheckpointError
from blockscale.nn import attention_modules, kv_format, kv_scales, nvfp4_kv_fake_quantize, set_kv_scales
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.quant.transforms.rotation import rotation
from blockscale.recipes import KVCacheScheme, get_ptq_recipe, ptq_recipe_from_dict

transformers = pytest.importorskip("transformers")
from reference_impl import E2M1_GRID, nvfp4_reference  # noqa: E402
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = token_ids(2, 12, seed=4)
CALIB = token_ids(8, 32, seed=0)
F32 = np.float32


def _scalar(t: torch.Tensor, s: float) -> torch.Tensor:
    """The scalar NVFP4 reference with outer encode scale 1 / s (bound 1/6 makes its S = 1 / amax, amax = s)."""
    x = t.detach().float().reshape(-1, t.shape[-1]).numpy()
    codes, scales, S = nvfp4_reference(x, bound=1.0 / 6.0, amax=s)
    inv = F32(1) / F32(S)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            q = codes[r, c]
            mag = F32(E2M1_GRID[q & 7])
            out[r, c] = F32(F32(F32(-mag if q & 8 else mag) * F32(scales[r, c // 16])) * inv)
    return torch.from_numpy(out).reshape(t.shape)


@pytest.mark.parametrize("factor", [1.0, 0.3])
def test_fake_quantize_is_the_scalar_reference(factor):
    t = torch.randn(2, 2, 5, 32, generator=torch.Generator().manual_seed(0)) * 3
    t[0, 1, 2, 7] = 40.0  # an outlier channel
    s = torch.tensor([float(t.abs().max()) / 448 * factor])
    got = nvfp4_kv_fake_quantize(t, s)
    assert torch.equal(got, _scalar(t, float(s)))
    assert float((got - t).abs().max()) > 0
    g = torch.ones_like(t)
    x = t.clone().requires_grad_()
    nvfp4_kv_fake_quantize(x, s).backward(g)
    assert torch.equal(x.grad, g)  # straight through


def _record(model):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen, name = [], f"bs_kv_nvfp4_{id(model)}"

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((key.detach().clone(), value.detach().clone()))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, recording)
    model.config._attn_implementation = name
    return seen


@pytest.mark.parametrize("r3", [False, True])
def test_attention_receives_nvfp4_kv(r3):
    from blockscale.ptq.rotations import parse_rotate, rotate_model

    raw, model = tiny_hf_llama(), tiny_hf_llama()
    seen_raw, seen = _record(raw), _record(model)
    if r3:
        rotate_model(model, parse_rotate("r3"))
    ks, vs = torch.tensor([0.002]), torch.tensor([0.003])
    for attn in attention_modules(model).values():
        set_kv_scales(attn, ks, vs, "nvfp4")
        assert kv_format(attn) == "nvfp4"
    with torch.no_grad():
        raw(IDS, use_cache=False)
        model(IDS, use_cache=False)
    h = rotation("hadamard", 16)
    for (k, v), (k_got, v_got) in zip(seen_raw[:1], seen[:1]):  # layer 0: the same inputs in both models
        want_k = h.unapply(nvfp4_kv_fake_quantize(h.apply(k), ks)) if r3 else nvfp4_kv_fake_quantize(k, ks)
        assert torch.equal(k_got, want_k) and torch.equal(v_got, nvfp4_kv_fake_quantize(v, vs))


def _quantized(kv="nvfp4", rotate="none"):
    model = tiny_hf_llama()
    recipe = get_ptq_recipe("nvfp4-experts-fp8-attention").replace(kv_cache=KVCacheScheme(kv))
    rep = quantize_model(model, PTQConfig(recipe=recipe, rotate=rotate, batch_size=8), CALIB, progress=False)
    return model, rep


def _logits(model):
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def test_ptq_calibrates_an_nvfp4_kv_cache():
    model, rep = _quantized()
    fp8, _ = _quantized("fp8-e4m3")
    for name, attn in attention_modules(model).items():
        assert kv_format(attn) == "nvfp4"
        e = rep.kv_cache[name]
        assert torch.equal(kv_scales(attn)[0], torch.tensor(e["k_amax"]) / 448)  # s = amax / 448, as FP8's
        assert kv_scales(attn)[0].shape == (1,)
    assert not torch.equal(_logits(model), _logits(fp8))


@pytest.mark.filterwarnings("ignore:an NVFP4 KV cache in a compressed-tensors checkpoint")
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_both_formats_round_trip(tmp_path, fmt):
    model, _ = _quantized()
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    from safetensors.torch import load_file
    tensors = load_file(str(out / "model.safetensors"))
    attn = "model.layers.0.self_attn"
    k = kv_scales(model.get_submodule(attn))[0]
    if fmt == "modelopt":
        hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hf["kv_cache_quant_algo"] == qcfg["kv_cache_quant_algo"] == "NVFP4" and qcfg["kv_cache_scheme"] == "NVFP4"
        stored = tensors[f"{attn}.k_proj.k_scale"]
        assert stored.shape == () and torch.equal(stored.reshape(1), k)  # amax / 448, as ModelOpt >= 0.42 writes
    else:
        assert qcfg["kv_cache_scheme"] == {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                                           "strategy": "tensor_group", "dynamic": "local"}
        assert torch.equal(tensors[f"{attn}.k_scale"], k)
    assert qcfg["blockscale"]["kv_cache"] == {"format": "nvfp4", "per_head": False}
    back = load_checkpoint(out)
    assert {kv_format(a) for a in attention_modules(back).values()} == {"nvfp4"}
    assert torch.equal(_logits(back), _logits(model))


def test_compressed_tensors_export_warns_no_engine_reads_it(tmp_path):
    model, _ = _quantized()
    with pytest.warns(UserWarning, match="no serving engine reads an NVFP4 kv_cache_scheme from compressed-tensors"):
        export_checkpoint(model, tmp_path / "ck")


def test_r3_with_nvfp4_kv_round_trips(tmp_path):
    model, rep = _quantized(rotate="r3")
    out = export_checkpoint(model, tmp_path / "ck")
    assert torch.equal(_logits(load_checkpoint(out)), _logits(model))


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="per_head=true with format 'nvfp4'"):
        KVCacheScheme("nvfp4", per_head=True)
    assert ptq_recipe_from_dict({"kv_cache": "nvfp4"}).kv_cache == KVCacheScheme("nvfp4")
    attn = tiny_hf_llama().model.layers[0].self_attn
    with pytest.raises(UsageError, match="one k_scale / v_scale per layer"):
        set_kv_scales(attn, torch.ones(2), torch.ones(2), "nvfp4")
    with pytest.raises(UsageError, match="allowed: fp8-e4m3, nvfp4"):
        set_kv_scales(attn, torch.ones(1), torch.ones(1), "int4")
    with pytest.raises(UsageError, match="not a multiple"):
        nvfp4_kv_fake_quantize(torch.ones(1, 1, 2, 24), torch.ones(1))
    model, _ = _quantized()
    set_kv_scales(model.model.layers[1].self_attn, torch.ones(1), torch.ones(1))  # layer 1 back to FP8
    with pytest.raises(ValueError, match="NVFP4 in some attention modules and FP8 in others"):
        export_checkpoint(model, tmp_path / "mixed")


def test_loader_refuses_a_bad_nvfp4_kv_scheme(tmp_path):
    model, _ = _quantized()
    with pytest.warns(UserWarning):
        out = export_checkpoint(model, tmp_path / "ck")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["group_size"] = 32
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not an NVFP4 KV cache blockscale loads"):
        load_checkpoint(out, verify=False)
