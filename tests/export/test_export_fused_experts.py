"""Export and reload of NVFP4 fused MoE experts (issue 16, deliverables 3 and 4): per-expert NVFP4 Linears
under the names each family's ``save_pretrained`` writes (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``,
Qwen3-MoE / OLMoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), in compressed-tensors and ModelOpt,
with the dtypes / shapes vLLM's MoE loaders read, gate and up of one expert sharing their outer (and
input) scale, routers ignored; ``load_checkpoint`` rebuilds ``NVFP4Experts`` with logits equal bit for bit
and refuses a checkpoint whose gate and up scales of one expert differ."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockscale.errors import CheckpointError
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn import NVFP4Experts
from blockscale.ptq import PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import checkpoint_tensors, moe_ids, moe_logits, token_ids  # noqa: E402
from tiny_moe import tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CT, MO = "compressed-tensors", "modelopt"
U8, E4M3, F32 = torch.uint8, torch.float8_e4m3fn, torch.float32
E = 4
# what vLLM's CompressedTensorsW4A4Nvfp4MoEMethod / ModelOptNvFp4FusedMoE load per expert Linear [N, K]:
# suffix -> (dtype, shape); they stack them into w13_* [E, 2, ...] / w2_* [E, ...]
LOADER_TABLE = {
    CT: lambda N, K, w4a4: {"weight_packed": (U8, [N, K // 2]), "weight_scale": (E4M3, [N, K // 16]),
                            "weight_global_scale": (F32, [1]),
                            **({"input_global_scale": (F32, [1])} if w4a4 else {})},
    MO: lambda N, K, w4a4: {"weight": (U8, [N, K // 2]), "weight_scale": (E4M3, [N, K // 16]),
                            "weight_scale_2": (F32, []), **({"input_scale": (F32, [])} if w4a4 else {})},
}
OUTER = {CT: "weight_global_scale", MO: "weight_scale_2"}
INPUT = {CT: "input_global_scale", MO: "input_scale"}
_QWEN = ("mlp", "gate_proj", "up_proj", "down_proj")
LEAVES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": _QWEN, "olmoe": _QWEN, "qwen2_moe": _QWEN}
FAMILIES = list(LEAVES)


_ids, _logits, _tensors = moe_ids, moe_logits, checkpoint_tensors


def _hub_weights(model, tmp_path) -> dict:
    """{name: shape} that transformers' save_pretrained writes for the float model."""
    d = tmp_path / "hub"
    model.save_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


_CACHE: dict = {}


def _quantized(family, w4a4):
    """(float model, its quantized copy): every Linear except the router and lm_head NVFP4, experts NVFP4Experts."""
    key = (family, w4a4)
    if key not in _CACHE:
        import copy
        model = tiny_moe(family)
        fl = copy.deepcopy(model)
        cfg = PTQConfig(activations="w4a4" if w4a4 else "w4a16", batch_size=2)
        quantize_model(model, cfg, token_ids(4, 16) if w4a4 else None, progress=False)
        assert sum(isinstance(m, NVFP4Experts) for m in model.modules()) == 2
        _CACHE[key] = (fl, model)
    return _CACHE[key]


@pytest.mark.parametrize("fmt", [CT, MO])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_experts_are_written_per_expert_under_the_hub_names_and_reload_bit_exact(tmp_path, family, fmt, w4a4):
    fl, model = _quantized(family, w4a4)
    hub = _hub_weights(fl, tmp_path)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    t = _tensors(out)
    rep = json.loads((out / "blockscale_report.json").read_text())
    quantized = set(rep["quantized_modules"])
    moe, g, u, d = LEAVES[family]
    experts = {f"model.layers.{layer}.{moe}.experts.{e}.{leaf}"
               for layer in (0, 1) for e in range(E) for leaf in (g, u, d)}
    assert experts <= quantized
    fe = rep["fused_experts"][f"model.layers.1.{moe}.experts"]
    assert fe["module"] == "model.layers.1.mlp.experts" and fe["experts"] == E
    assert fe["linears"] == {"gate": g, "up": u, "down": d}
    # every name save_pretrained writes is there: quantized Linears' weight replaced by the format's tensors
    want = {}
    for k, shape in hub.items():
        mod, _, leaf = k.rpartition(".")
        if mod in quantized and leaf == "weight":
            for suf, (dt, s) in LOADER_TABLE[fmt](shape[0], shape[1], w4a4).items():
                want[f"{mod}.{suf}"] = (dt, s)
        else:
            want[k] = (None, shape)
    assert set(t) == set(want), sorted(set(t) ^ set(want))[:10]
    for k, (dt, shape) in want.items():
        assert list(t[k].shape) == shape, k
        if dt is not None:
            assert t[k].dtype == dt, k
    # gate and up of one expert share their outer (and input) scale; each expert has its own
    for layer in (0, 1):
        p = f"model.layers.{layer}.{moe}.experts"
        outers = []
        for e in range(E):
            for suffix in (OUTER[fmt],) + ((INPUT[fmt],) if w4a4 else ()):
                assert torch.equal(t[f"{p}.{e}.{g}.{suffix}"], t[f"{p}.{e}.{u}.{suffix}"]), (p, e, suffix)
            outers.append(float(t[f"{p}.{e}.{g}.{OUTER[fmt]}"]))
        assert len(set(outers)) == E
    # routers in ignore / exclude_modules under their hub names; the per-expert Linears are targeted
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = [f"model.layers.{layer}.{moe}.gate" for layer in (0, 1)]
    if fmt == CT:
        ignore = cfg["ignore"]
        assert [gr["targets"] for gr in cfg["config_groups"].values()] == [["Linear"]]
    else:
        ignore = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert set(routers) <= set(ignore) and not any(".experts." in n for n in ignore)
    # reload
    back = load_checkpoint(out)
    ex = {n: m for n, m in back.named_modules() if isinstance(m, NVFP4Experts)}
    assert len(ex) == 2 and all(m.scheme_name == ("nvfp4-w4a4" if w4a4 else "nvfp4-w4a16") for m in ex.values())
    mods = dict(model.named_modules())
    for n, m in ex.items():
        for b, v in m.named_buffers():
            w = getattr(mods[n], b)
            if v.dtype == E4M3:
                v, w = v.view(U8), w.view(U8)
            elif fmt == MO and b.endswith("_weight_global_scale"):  # ModelOpt stores fl(1/S): what dequantizes
                v, w = 1.0 / v, 1.0 / w
            assert torch.equal(v, w), (n, b)
    assert torch.equal(_logits(back), _logits(model))


def _rewrite(out: Path, fn):
    f = out / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("fmt", [CT, MO])
@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_gate_and_up_scales_of_one_expert_must_be_equal(tmp_path, family, fmt):
    _, model = _quantized(family, False)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    moe, g, u, _ = LEAVES[family]
    key = f"model.layers.1.{moe}.experts.2.{u}.{OUTER[fmt]}"
    _rewrite(out, lambda t: t.__setitem__(key, t[key] * 2))
    p = f"model.layers.1.{moe}.experts"
    want = (re.escape(f"fused MoE experts {p}, expert 2: gate {p}.2.{g}.{OUTER[fmt]}=") + ".*"
            + re.escape(f"up {p}.2.{u}.{OUTER[fmt]}=") + ".*differ")
    with pytest.raises(CheckpointError, match=want):
        load_checkpoint(out, verify=False)


def test_shape_mismatch_of_an_expert_is_refused(tmp_path):
    _, model = _quantized("qwen3_moe", False)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    key = "model.layers.0.mlp.experts.3.down_proj.weight_packed"
    _rewrite(out, lambda t: t.__setitem__(key, t[key][:, :-1].contiguous()))
    with pytest.raises(CheckpointError, match=re.escape(key)):
        load_checkpoint(out, verify=False)


def test_partly_quantized_experts_are_refused(tmp_path):
    model = tiny_moe("qwen3_moe")
    quantize_model(model, PTQConfig(exclude=["lm_head", r"layers\.1\.mlp\.experts$"]), progress=False)
    with pytest.raises(ValueError, match="partly quantized"):
        export_checkpoint(model, tmp_path / "ck", CT)


def test_unsupported_family_is_refused(tmp_path):
    _, model = _quantized("olmoe", False)
    model.config.model_type = "my_moe"
    try:
        with pytest.raises(ValueError, match=r"model_type='my_moe': quantized fused MoE experts can be stored for the "
                                             r"model types deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe "
                                             r"only"):
            export_checkpoint(model, tmp_path / "ck", CT)
    finally:
        del model.config.model_type
    assert not (tmp_path / "ck").exists()


def test_cli_quantize_exports_experts_and_with_them_excluded(tmp_path, capsys):
    from blockscale import cli

    tiny_moe("mixtral").save_pretrained(tmp_path / "mix")  # no tokenizer: RTN W4A16
    assert cli.main(["quantize", str(tmp_path / "mix"), "--out", str(tmp_path / "q")]) == 0
    t = _tensors(tmp_path / "q")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in t
    assert not any("gate_up_proj" in k or ".mlp." in k for k in t)
    back = load_checkpoint(tmp_path / "q")
    assert isinstance(back.model.layers[1].mlp.experts, NVFP4Experts)
    assert cli.main(["quantize", str(tmp_path / "mix"), "--exclude", "experts$", "--allow-partial",
                     "--out", str(tmp_path / "q2")]) == 0
    t = _tensors(tmp_path / "q2")
    # high precision, per expert under the hub names save_pretrained writes, module and Linears ignored
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in t
    assert not any("gate_up_proj" in k or ".mlp." in k for k in t)
    cfg = json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.block_sparse_moe.experts", "model.layers.0.block_sparse_moe.experts.3.w2",
            "model.layers.0.block_sparse_moe.experts.0.gate_proj"} <= set(cfg["ignore"])  # + vLLM's probe name
    assert type(load_checkpoint(tmp_path / "q2").model.layers[0].mlp.experts).__name__ == "MixtralExperts"


@pytest.mark.parametrize("fmt", [CT, MO])
def test_gate_and_up_input_scales_of_one_expert_must_be_equal(tmp_path, fmt):
    _, model = _quantized("qwen3_moe", True)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    key = f"model.layers.0.mlp.experts.1.gate_proj.{INPUT[fmt]}"
    _rewrite(out, lambda t: t.__setitem__(key, t[key] * 2))
    with pytest.raises(CheckpointError, match=r"fused MoE experts model\.layers\.0\.mlp\.experts, expert 1: gate "
                                              + re.escape(f"{key}=") + ".*differ"):
        load_checkpoint(out, verify=False)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_mixed_recipe_experts_nvfp4_attention_fp8_reloads_bit_exact(tmp_path, fmt):
    model = tiny_moe("mixtral")
    quantize_model(model, PTQConfig(recipe="nvfp4-experts-fp8-attention", batch_size=2), token_ids(4, 16),
                   progress=False)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    t = _tensors(out)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale" in t
    assert "model.layers.1.self_attn.q_proj.weight_scale" in t and not any(".mlp." in k for k in t)
    back = load_checkpoint(out)
    assert isinstance(back.model.layers[0].mlp.experts, NVFP4Experts)
    assert torch.equal(_logits(back), _logits(model))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.xfail(reason="transformers 5.24's CompressedTensorsDequantize decompresses fused NVFP4 experts without "
                          "their weight_global_scale (weights q * s, not q * s / S); see docs/formats.md", strict=False)
def test_transformers_compressed_tensors_runs_the_moe_export(tmp_path):
    from transformers import AutoModelForCausalLM

    _, model = _quantized("qwen3_moe", False)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    hf = AutoModelForCausalLM.from_pretrained(out)  # loads: no missing / unexpected keys
    ref = _logits(model)
    assert (_logits(hf).float() - ref).abs().max() <= 0.05
