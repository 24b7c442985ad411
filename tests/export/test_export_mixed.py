"""Mixed-precision checkpoints (issue 15): any mix of NVFP4Linear / FP8Linear / MXLinear plus FP8
KV-cache scales, in compressed-tensors and ModelOpt: exact tensor names / dtypes / shapes and configs
per scheme and for the write-up's mix (attention fp8-w8a8 static, MLP nvfp4-w4a4, per-layer KV
scales), ``load_checkpoint`` reproducing the logits bit for bit, transformers + compressed-tensors
loading the mixed export, and corrupted values refused. Quantized test models are built directly
from the nn modules (no PTQ): fused groups share their scales as PTQ makes them."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockscale as bs
from blockscale.errors import CheckpointError
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn import FP8Linear, MXLinear, NVFP4Linear, attention_modules, kv_scales, set_kv_scales
from blockscale.nn.fused import fused_groups
from blockscale.quant import QuantizedTensor
from blockscale.quant.nvfp4 import input_encode_scale, outer_scale

transformers = pytest.importorskip("transformers")
from nvfp4_checkpoints import model_logits, sample_ids  # noqa: E402  (ids < 64: inside this file's vocabulary too)
from tiny_models import checkpoint_tensors  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

CT, MO = "compressed-tensors", "modelopt"
VOCAB, H, I = 128, 64, 128
E4M3 = torch.float8_e4m3fn


def _replace(root, name, new):
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent), child, new)


def _fp8_tensor(w, s):
    """Independent FP8 per-tensor reference: torch's own cast of clamp(w / s)."""
    return (w.float() / s).clamp(-448, 448).to(E4M3)


def _quantize_group(scheme, ws, biases, in_amax, dtype):
    """Quantized modules for one fused group (shared NVFP4 S / FP8 per-tensor s / static input scales)."""
    amax = torch.stack([w.detach().float().abs().max() for w in ws]).max()
    out = []
    for w, b in zip(ws, biases):
        if scheme.startswith("nvfp4"):
            spec = bs.NVFP4()
            q = bs.quantize(w.detach(), spec, encode_scale=outer_scale(amax, spec.outer_bound))
            kw = dict(input_global_scale=input_encode_scale(in_amax, "6"), input_scale_rule="6") \
                if scheme == "nvfp4-w4a4" else {}
            out.append(NVFP4Linear.from_quantized(q, b, dtype=dtype, **kw))
        elif scheme in ("fp8-w8a8", "fp8-tensor-token", "fp8-w8a16"):
            s = (amax / 448).reshape(())
            q = QuantizedTensor(spec=bs.FP8("e4m3", "tensor"), codes=_fp8_tensor(w, s), scales=s, shape=w.shape,
                                dtype=w.dtype)
            g = {"fp8-w8a8": "tensor", "fp8-tensor-token": "token", "fp8-w8a16": None}[scheme]
            out.append(FP8Linear.from_quantized(q, b, input_granularity=g, dtype=dtype,
                                                input_scale=torch.tensor([in_amax / 448]) if g == "tensor" else None))
        elif scheme == "fp8-channel-token":
            q = bs.quantize(w.detach(), bs.FP8("e4m3", "channel"))
            out.append(FP8Linear.from_quantized(q, b, input_granularity="token", dtype=dtype))
        elif scheme == "fp8-block":
            q = bs.quantize(w.detach(), bs.FP8("e4m3", "block", (128, 128)))
            out.append(FP8Linear.from_quantized(q, b, input_granularity="block", dtype=dtype))
        else:
            element = "e4m3" if scheme == "mxfp8" else "e2m1"
            q = bs.quantize(w.detach(), bs.MX(element))
            out.append(MXLinear.from_quantized(q, b, dtype=dtype, input_element=None if scheme == "mxfp4-w4a16"
                                               else element, scale_rule="floor" if scheme == "mxfp4" else None))
    return out


def make_model(attention, mlp=None, *, kv=None, dtype=torch.float32, bias=False, seed=0):
    """Tiny Llama: attention Linears ``attention``, MLP Linears ``mlp`` (default: the same);
    ``kv``: None, "tensor" (k/v scale per layer) or "head" (per KV head)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=bias)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    lins = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    with torch.no_grad():
        for m in lins.values():
            m.weight.mul_(torch.rand(m.out_features, 1, generator=g).to(dtype) * 3)
    for group in fused_groups(list(lins)):
        scheme = attention if ".self_attn." in group[0] else (mlp or attention)
        in_amax = 2.0 + float(torch.rand((), generator=g)) * 4
        mods = _quantize_group(scheme, [lins[n].weight for n in group], [lins[n].bias for n in group], in_amax, dtype)
        for n, m in zip(group, mods):
            _replace(model, n, m)
    for i, attn in enumerate(attention_modules(model).values()):
        if kv is not None:
            n = 1 if kv == "tensor" else 2
            set_kv_scales(attn, torch.rand(n, generator=g) * 0.01 + 0.002 * (i + 1),
                          torch.rand(n, generator=g) * 0.01 + 0.001)
    return model


def _qcfg(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


A, M = "model.layers.0.self_attn", "model.layers.0.mlp"
N_ATTN = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64}

# scheme -> format -> {suffix: (dtype, shape)} of model.layers.0.self_attn.q_proj (N = K = 64)
LAYOUT = {
    "nvfp4-w4a4": {CT: {"weight_packed": (torch.uint8, [64, 32]), "weight_scale": (E4M3, [64, 4]),
                        "weight_global_scale": (torch.float32, [1]), "input_global_scale": (torch.float32, [1])},
                   MO: {"weight": (torch.uint8, [64, 32]), "weight_scale": (E4M3, [64, 4]),
                        "weight_scale_2": (torch.float32, []), "input_scale": (torch.float32, [])}},
    "fp8-w8a8": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [1]),
                      "input_scale": (torch.float32, [1])},
                 MO: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, []),
                      "input_scale": (torch.float32, [])}},
    "fp8-channel-token": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [64, 1])},
                          MO: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [64])}},
    "fp8-tensor-token": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [1])}},
    "fp8-w8a16": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [1])}},
    "fp8-block": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.float32, [1, 1])}},
    "mxfp8": {CT: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.uint8, [64, 2])},
              MO: {"weight": (E4M3, [64, 64]), "weight_scale": (torch.uint8, [64, 2])}},
    "mxfp4": {CT: {"weight_packed": (torch.uint8, [64, 32]), "weight_scale": (torch.uint8, [64, 2])}},
    "mxfp4-w4a16": {CT: {"weight_packed": (torch.uint8, [64, 32]), "weight_scale": (torch.uint8, [64, 2])}},
}
# compressed-tensors group: (format, weights strategy, input_activations (strategy, dynamic) or None)
CT_GROUP = {"nvfp4-w4a4": ("nvfp4-pack-quantized", "tensor_group", ("tensor_group", "local")),
            "fp8-w8a8": ("float-quantized", "tensor", ("tensor", False)),
            "fp8-channel-token": ("float-quantized", "channel", ("token", True)),
            "fp8-tensor-token": ("float-quantized", "tensor", ("token", True)),
            "fp8-w8a16": ("naive-quantized", "tensor", None),
            "fp8-block": ("float-quantized", "block", ("group", True)),
            "mxfp8": ("mxfp8-quantized", "group", ("group", True)),
            "mxfp4": ("mxfp4-pack-quantized", "group", ("group", True)),
            "mxfp4-w4a16": ("mxfp4-pack-quantized", "group", None)}
MO_ALGO = {"nvfp4-w4a4": "NVFP4", "fp8-w8a8": "FP8", "fp8-channel-token": "FP8_PER_CHANNEL_PER_TOKEN",
           "mxfp8": "MXFP8"}
CASES = [(s, f) for s in LAYOUT for f in (CT, MO) if f in LAYOUT[s]]


@pytest.mark.parametrize("scheme,fmt", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_one_scheme_names_config_and_exact_reload(tmp_path, scheme, fmt):
    model = make_model(scheme, kv="tensor")
    ref = model_logits(model)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    t = checkpoint_tensors(out)
    q = f"{A}.q_proj"
    got = {k[len(q) + 1:]: (v.dtype, list(v.shape)) for k, v in t.items() if k.startswith(q + ".")}
    assert got == LAYOUT[scheme][fmt]
    if scheme.startswith("fp8") and scheme != "fp8-channel-token" and scheme != "fp8-block":
        m = model.get_submodule(q)
        s = m.weight_scale.reshape(())
        w = m.dequantized_weight(torch.float32)  # codes * s: re-encoding with s gives the same codes
        assert torch.equal(t[f"{q}.weight"].view(torch.uint8), _fp8_tensor(w, s).view(torch.uint8))
    qc = _qcfg(out)
    kv = True
    if fmt == CT:
        (g,) = qc["config_groups"].values()
        form, ws, acts = CT_GROUP[scheme]
        assert g["targets"] == ["Linear"] and g["format"] == form == qc["format"]
        assert g["weights"]["strategy"] == ws
        assert (None if g["input_activations"] is None else
                (g["input_activations"]["strategy"], g["input_activations"]["dynamic"])) == acts
        assert qc["kv_cache_scheme"] == ({"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                          "strategy": "tensor", "dynamic": False} if kv else None)
        if kv:
            assert t[f"{A}.k_scale"].dtype == torch.float32 and t[f"{A}.k_scale"].shape == (1,)
    else:
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == qc["quant_algo"] == MO_ALGO[scheme] and "quantized_layers" not in hq
        assert hq["kv_cache_quant_algo"] == ("FP8" if kv else None)
        if kv:
            assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
            assert t[f"{A}.k_proj.k_scale"].shape == () and f"{A}.k_scale" not in t
    back = load_checkpoint(out)
    assert torch.equal(model_logits(back), ref)
    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, MXLinear, NVFP4Linear)):
            b = back.get_submodule(name)
            assert type(b) is type(m) and b.scheme_name == m.scheme_name
            assert torch.equal(b.dequantized_weight(torch.float32), m.dequantized_weight(torch.float32))
            if isinstance(m, MXLinear):
                assert b.scale_rule == m.scale_rule
    for name, attn in attention_modules(model).items():
        if kv:
            assert all(torch.equal(x, y) for x, y in zip(kv_scales(back.get_submodule(name)), kv_scales(attn)))


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-tensor-token", "fp8-w8a16", "mxfp4", "mxfp4-w4a16"])
def test_modelopt_refuses_schemes_without_quant_algo(tmp_path, scheme):
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.self_attn\.q_proj: scheme {scheme.split('-')[0]}.*"
                                         r"use format='compressed-tensors'"):
        export_checkpoint(make_model(scheme), tmp_path / "ck", MO)
    assert not (tmp_path / "ck").exists()


def test_modelopt_refuses_per_head_kv_and_pcpt_in_a_mix(tmp_path):
    with pytest.raises(ValueError, match="per-head KV-cache scales.*compressed-tensors"):
        export_checkpoint(make_model("fp8-w8a8", kv="head"), tmp_path / "a", MO)
    with pytest.raises(ValueError, match=r"FP8_PER_CHANNEL_PER_TOKEN\) cannot be one of several schemes"):
        export_checkpoint(make_model("fp8-channel-token", "nvfp4-w4a4"), tmp_path / "b", MO)


def test_a_split_fused_group_is_refused(tmp_path):
    model = make_model("fp8-w8a8", "nvfp4-w4a4")
    k = model.get_submodule(f"{A}.k_proj")
    q = bs.quantize(k.dequantized_weight(torch.float32), bs.MX("e4m3"))
    _replace(model, f"{A}.k_proj", MXLinear.from_quantized(q, input_element="e4m3"))
    for fmt in (CT, MO):
        with pytest.raises(ValueError, match=rf"fused modules \['{A}\.q_proj', '{A}\.k_proj', '{A}\.v_proj'\] have "
                                             rf"different schemes \({A}\.q_proj: fp8-w8a8 tensor/tensor, {A}\.k_proj: "
                                             r"mxfp8"):
            export_checkpoint(model, tmp_path / fmt, fmt)


def test_kv_scales_on_some_attention_modules_only_are_refused(tmp_path):
    model = make_model("fp8-w8a8", "nvfp4-w4a4", kv="tensor")
    bs.nn.remove_kv_quantization(model.get_submodule("model.layers.1.self_attn"))
    with pytest.raises(ValueError, match=r"every attention module .*missing on: \['model\.layers\.1\.self_attn'\]"):
        export_checkpoint(model, tmp_path / "ck", CT)


def test_unshared_fp8_input_scales_are_refused(tmp_path):
    model = make_model("fp8-w8a8", "nvfp4-w4a4")
    model.get_submodule(f"{A}.v_proj").input_scale.mul_(2)
    with pytest.raises(ValueError, match=r"different FP8 input_scale \(static activation scale\)"):
        export_checkpoint(model, tmp_path / "ck", CT)


def _mixed():
    return make_model("fp8-w8a8", "nvfp4-w4a4", kv="tensor", bias=True)


def test_mixed_compressed_tensors(tmp_path):
    model = _mixed()
    out = export_checkpoint(model, tmp_path / "ck", CT)
    qc = _qcfg(out)
    assert qc["format"] == "mixed-precision"
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    attn = sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in N_ATTN)
    mlp = sorted(f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj"))
    assert (g0["targets"], g0["format"]) == (attn, "float-quantized")
    assert g0["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                             "strategy": "tensor", "dynamic": False}
    assert g0["input_activations"] == {**g0["weights"], "observer": "static_minmax"}
    assert (g1["targets"], g1["format"]) == (mlp, "nvfp4-pack-quantized")
    assert g1["input_activations"]["dynamic"] == "local"
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"]["strategy"] == "tensor"
    assert qc["blockscale"]["scheme"] == "MIXED" and qc["blockscale"]["kv_cache"] == {"format": "fp8-e4m3",
                                                                                        "per_head": False}
    t = checkpoint_tensors(out)
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        for p, n in N_ATTN.items():
            assert (t[f"{a}.{p}.weight"].dtype, list(t[f"{a}.{p}.weight"].shape)) == (E4M3, [n, 64])
            assert list(t[f"{a}.{p}.weight_scale"].shape) == [1] and list(t[f"{a}.{p}.input_scale"].shape) == [1]
        for which in ("k_scale", "v_scale"):
            assert (t[f"{a}.{which}"].dtype, list(t[f"{a}.{which}"].shape)) == (torch.float32, [1])
            assert torch.equal(t[f"{a}.{which}"], getattr(model.get_submodule(a), which))
        assert list(t[f"model.layers.{i}.mlp.down_proj.weight_packed"].shape) == [64, 64]
    assert torch.equal(t[f"{A}.q_proj.weight_scale"], t[f"{A}.v_proj.weight_scale"])  # fused: one s
    assert str(bs.export.size_breakdown(out)).startswith("checkpoint ") and "quantized weights" in \
        str(bs.export.size_breakdown(out))
    back = load_checkpoint(out)
    assert torch.equal(model_logits(back), model_logits(model))


def test_mixed_modelopt(tmp_path):
    model = _mixed()
    out = export_checkpoint(model, tmp_path / "ck", MO)
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    qc = _qcfg(out)
    assert hq["quant_algo"] == qc["quant_algo"] == "MIXED_PRECISION" and hq["kv_cache_quant_algo"] == "FP8"
    layers = hq["quantized_layers"]
    assert layers == qc["quantized_layers"] and len(layers) == 14
    assert layers[f"{A}.q_proj"] == {"quant_algo": "FP8"}
    assert layers[f"{M}.up_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert hq["exclude_modules"] == qc["ignore"] == ["lm_head"]
    assert [g["targets"][0] for g in qc["config_groups"].values()] == [f"{A}.k_proj", f"{M}.down_proj"]
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    t = checkpoint_tensors(out)
    assert t[f"{A}.k_proj.k_scale"].shape == () and t[f"{A}.v_proj.v_scale"].shape == ()
    assert float(t[f"{A}.k_proj.k_scale"]) == float(model.get_submodule(A).k_scale)
    assert (t[f"{A}.o_proj.weight_scale"].shape, t[f"{A}.o_proj.input_scale"].shape) == ((), ())
    assert t[f"{M}.up_proj.weight_scale_2"].shape == ()
    back = load_checkpoint(out)
    assert torch.equal(model_logits(back), model_logits(model))


def test_per_head_kv_and_bf16_reload(tmp_path):
    model = make_model("mxfp8", "nvfp4-w4a4", kv="head", dtype=torch.bfloat16)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    assert _qcfg(out)["kv_cache_scheme"]["strategy"] == "attn_head"
    assert list(checkpoint_tensors(out)[f"{A}.k_scale"].shape) == [2, 1, 1]
    back = load_checkpoint(out)
    assert kv_scales(back.get_submodule(A))[0].shape == (2,)
    assert torch.equal(model_logits(back), model_logits(model))


# How close, and why not equal: transformers runs compressed-tensors' decompressed weights in bfloat16
# (FP8: codes x s rounded to bf16; NVFP4 likewise) with its own FP8 static-tensor / FP4 activation
# quantization, while ours runs FP32 on the same codes. bf16 rounding (2^-9 relative per op) moves
# some inputs across an FP4 / FP8 rounding boundary (a whole code step). Also transformers 5.24 +
# compressed-tensors 0.20.1 leave k_scale / v_scale unloaded (reported UNEXPECTED: CT's
# is_cached_attention_module looks for a past_key_value(s) argument, 5.24's attention forward takes
# `cache`), so its K / V run unquantized. Measured 0.048 on logits of magnitude <= ~0.6: 0.15.
TRANSFORMERS_ATOL = 0.15


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_transformers_loads_the_mixed_compressed_tensors_export(tmp_path):
    pytest.importorskip("compressed_tensors")
    model = _mixed()
    out = export_checkpoint(model, tmp_path / "ck", CT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    with torch.no_grad():
        theirs = hf(sample_ids()).logits.float()
    ref = model_logits(model)
    diff = float((theirs - ref).abs().max())
    assert diff <= TRANSFORMERS_ATOL, diff
    assert float(ref.abs().max()) > 3 * diff


def _rewrite(out: Path, fn):
    f = out / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("fmt", [CT, MO])
def test_corrupted_values_are_refused(tmp_path, fmt):
    src = export_checkpoint(_mixed(), tmp_path / "src", fmt)
    k = f"{A}.k_scale" if fmt == CT else f"{A}.k_proj.k_scale"

    def nan_byte(t):
        w = t[f"{A}.q_proj.weight"].view(torch.uint8).clone()
        w[3, 5] = 0x7F
        t[f"{A}.q_proj.weight"] = w.view(E4M3)

    cases = [(nan_byte, rf"'{A}\.q_proj\.weight': 1 of 4096 E4M3 codes are NaN \(first at \[3, 5\], byte 0x7f\)"),
             (lambda t: t[f"{A}.o_proj.input_scale"].zero_(), rf"'{A}\.o_proj\.input_scale': 1 of 1 scales are not "
                                                              r"finite and > 0"),
             (lambda t: t[k].neg_(), rf"'{k}': 1 of 1 scales are not finite and > 0")]
    for i, (edit, msg) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        _rewrite(d, edit)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor " + msg):
            load_checkpoint(d)


def test_ue8m0_nan_and_unknown_config_entries_are_refused(tmp_path):
    src = export_checkpoint(make_model("mxfp8", kv="tensor"), tmp_path / "src", CT)
    d = tmp_path / "d"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _rewrite(d, lambda t: t[f"{M}.up_proj.weight_scale"].view(-1)[0:1].fill_(255))
    with pytest.raises(CheckpointError, match=rf"'{M}\.up_proj\.weight_scale': 1 of .* UE8M0 scale bytes are 255"):
        load_checkpoint(d)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.kv_cache_scheme: .*strategy"):
        load_checkpoint(d)
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.config_groups\.group_0\.weights: "
                                              r"unknown field\(s\) \['block_size'\]"):
        load_checkpoint(d)
    del cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_size"]
    cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "int-quantized"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config: format 'int-quantized' of "
                                              r"quantization_config\.config_groups\.group_0"):
        load_checkpoint(d)

    mo = export_checkpoint(_mixed(), tmp_path / "mo", MO)
    hq = json.loads((mo / "hf_quant_config.json").read_text())
    hq["quantization"]["quantized_layers"][f"{A}.q_proj"]["quant_algo"] = "INT8"
    (mo / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: quantization\.quantized_layers\['model\.layers"
                                              r"\.0\.self_attn\.q_proj'\]\.quant_algo 'INT8' is not supported"):
        load_checkpoint(mo)


def test_other_target_forms_and_inline_only_modelopt(tmp_path):
    model = _mixed()
    ref = model_logits(model)
    ct = export_checkpoint(model, tmp_path / "ct", CT)
    cfg = json.loads((ct / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_0"]["targets"] = [r"re:.*self_attn\.(q|k|v|o)_proj$"]  # compressed-tensors' regex form
    groups["group_1"]["targets"] = ["Linear"]  # the rest: by type (exact names and regexes win)
    (ct / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(model_logits(load_checkpoint(ct, verify=False)), ref)

    mo = export_checkpoint(model, tmp_path / "mo", MO)
    (mo / "hf_quant_config.json").unlink()  # config.json's inline MIXED_PRECISION config alone
    assert torch.equal(model_logits(load_checkpoint(mo)), ref)

    mo2 = export_checkpoint(model, tmp_path / "mo2", MO)
    hq = json.loads((mo2 / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = None
    (mo2 / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: quantization\.kv_cache_quant_algo None "
                                              r"disagrees with config\.json"):
        load_checkpoint(mo2)


# compressed-tensors' own presets for our schemes (its quant_scheme.py)
PRESET = {"nvfp4-w4a4": "NVFP4", "fp8-w8a8": "FP8", "fp8-channel-token": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK",
          "mxfp8": "MXFP8", "mxfp4": "MXFP4", "mxfp4-w4a16": "MXFP4A16"}


@pytest.mark.parametrize("scheme", list(PRESET))
def test_compressed_tensors_schema_accepts_our_groups(tmp_path, scheme):
    """Its pydantic QuantizationConfig parses our config; each group equals its preset and dumps to
    exactly what we wrote."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    other = "fp8-w8a8" if scheme.startswith("nvfp4") else "nvfp4-w4a4"
    out = export_checkpoint(make_model(scheme, other, kv="tensor"), tmp_path / "ck", CT)
    ours = _qcfg(out)
    parsed = QuantizationConfig.model_validate(ours)
    preset = preset_name_to_scheme(PRESET[scheme], ["Linear"])
    group = parsed.config_groups["group_0"]

    def same(a, b):  # zp_dtype is not serialized (model_dump leaves it out): symmetric, no zero point
        return (a is None and b is None) or a.model_dump() == b.model_dump()

    assert same(group.weights, preset.weights) and same(group.input_activations, preset.input_activations)
    assert parsed.format == "mixed-precision" and parsed.kv_cache_scheme.strategy == "tensor"
    assert json.loads(json.dumps(parsed.model_dump()["config_groups"], default=str)) == ours["config_groups"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("scheme", ["fp8-w8a8", "fp8-channel-token", "fp8-block", "mxfp8", "mxfp4"])
def test_compressed_tensors_decompresses_our_weights_exactly(tmp_path, scheme):
    """transformers (compressed-tensors quantizer, dequantize=True, float32) rebuilds dense weights
    equal to ours bit for bit: FP8 q * s and MX v * 2**(b - 127) are single exact FP32 products.
    (One scheme: transformers 5.24's dequantize path decompresses every dense layer with one config
    group, ``get_dense_scheme``, so it cannot dequantize a mixed checkpoint.)"""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = make_model(scheme)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    hf = AutoModelForCausalLM.from_pretrained(str(out), quantization_config=CompressedTensorsConfig(dequantize=True),
                                              dtype=torch.float32)
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, MXLinear)):
            assert torch.equal(hf.get_submodule(name).weight, m.dequantized_weight(torch.float32)), name
            n += 1
    assert n == 14


def test_a_format_without_mixed_support_refuses_fp8_and_kv(tmp_path):
    import dataclasses

    import blockscale.export as ex

    from blockscale.export import ct_codecs

    fmt = ex.register_format(dataclasses.replace(ex.FORMATS[CT], name="nvfp4-only", aliases=(), kv=None))
    ex.register_codec(dataclasses.replace(ct_codecs.NVFP4, format=fmt.name))
    try:
        with pytest.raises(ValueError, match=r"'nvfp4-only' stores NVFP4 Linears only, not fp8-w8a8; use "
                                             r"format='compressed-tensors'"):
            export_checkpoint(_mixed(), tmp_path / "a", fmt.name)
        with pytest.raises(ValueError, match="not FP8 KV-cache scales"):
            export_checkpoint(make_model("nvfp4-w4a4", kv="tensor"), tmp_path / "b", fmt.name)
    finally:
        ex.unregister_format(fmt.name)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
