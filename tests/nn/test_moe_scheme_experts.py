"""FP8 and MX schemes on fused MoE experts (``nn.scheme_experts.SchemeExperts``): mixed recipes give the
``experts`` module class fp8-w8a8 (tensor / channel weights, static / dynamic activations), fp8-block, mxfp8,
mxfp4 or mxfp4-w4a16. References are written here: E4M3 codes from torch's own float8 cast with the scale
computed by hand, the static input scales from the routed calibration inputs captured by hand, and a
per-token expert loop over the per-expert FP8Linear / MXLinear modules."""
import copy

import pytest
import torch
from safetensors.torch import load_file

from blockscale.errors import QuantizationError
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn import FP8Linear, MXLinear, SchemeExperts
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.quant import FP8, MX, quantize
from blockscale.recipes.ptq_recipe import PTQRecipe, PTQRule, Scheme

transformers = pytest.importorskip("transformers")
from tiny_moe import COMMON, tiny_gpt_oss, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CT, MO = "compressed-tensors", "modelopt"
SCHEMES = {
    "fp8-tensor-static": Scheme("fp8-w8a8", weights="tensor", activations="static"),
    "fp8-channel-dynamic": Scheme("fp8-w8a8", weights="channel", activations="dynamic"),
    "fp8-block": Scheme("fp8-block"),
    "mxfp8": Scheme("mxfp8"),
    "mxfp4-w4a16": Scheme("mxfp4-w4a16"),
    "mxfp4": Scheme("mxfp4"),
}


def _recipe(scheme, default="nvfp4-w4a16"):
    return PTQRecipe(default=Scheme(default), rules=(PTQRule("experts", scheme),))


def _model(key, family="mixtral", seed=0):
    if key == "fp8-block" and family == "mixtral":  # gate / up split on 128-row tiles: I = 128
        cfg = transformers.MixtralConfig(**{**COMMON, "hidden_size": 128}, intermediate_size=128,
                                         num_local_experts=4, num_experts_per_tok=2)
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return tiny_gpt_oss() if family == "gpt_oss" else tiny_moe(family, seed=seed)


def _calib(seed=1, n=4, T=16):
    return torch.randint(0, 96, (n, T), generator=torch.Generator().manual_seed(seed))


def _quantize(key, family="mixtral", outer="expert", method="rtn", **kw):
    model = _model(key, family)
    ref = copy.deepcopy(model)
    calib = _calib()
    report = quantize_model(model, PTQConfig(method=method, recipe=_recipe(SCHEMES[key]), expert_outer_scale=outer,
                                             **kw), calib, progress=False)
    return ref, model, calib, report


def _float_matrices(experts):
    """(gate_up [E, 2I, H], down [E, H, I]) out x in matrices of a float experts module."""
    if type(experts).__name__ == "GptOssExperts":
        return experts.gate_up_proj.detach().transpose(1, 2), experts.down_proj.detach().transpose(1, 2)
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


def _capture(module, model, ids):
    """The (hidden_states, top_k_index, top_k_weights) of every call of ``module`` while ``model`` runs."""
    calls = []
    h = module.register_forward_hook(lambda m, a, kw, o: calls.append(tuple(a) + tuple(kw.values())), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    h.remove()
    return calls


@pytest.mark.parametrize("key", list(SCHEMES))
def test_stored_weights_are_each_experts_own_quantization(key):
    """Every expert's gate_up / down weight is that expert's matrix quantized on its own; per-tensor FP8: by
    hand, s = max(amax gate, amax up) / 448 (one scale for gate and up of one expert) and codes = torch's E4M3
    cast of w / s."""
    ref, model, _, report = _quantize(key)
    for layer_f, layer_q in zip(ref.model.layers, model.model.layers):
        q = layer_q.mlp.experts
        assert isinstance(q, SchemeExperts) and q.scheme_name == SCHEMES[key].name
        W = _float_matrices(layer_f.mlp.experts)
        for p, Wp in zip(("gate_up", "down"), W):
            for e in range(Wp.shape[0]):
                w, got = Wp[e], q.quantized_weight(p, e)
                if key == "fp8-tensor-static":
                    s = w.abs().amax().to(torch.float32) / 448
                    assert torch.equal(got.scales.reshape(()), s)
                    assert torch.equal(got.codes.view(torch.uint8), (w / s).to(torch.float8_e4m3fn).view(torch.uint8))
                else:
                    want = quantize(w, got.spec)
                    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
                    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert report.experts and all(r.scheme.startswith(SCHEMES[key].name) for r in report.experts)


def test_static_input_scales_are_the_routed_amax_over_448():
    """Layer 0 (its inputs are the embeddings either way): expert e's gate_up input scale is the amax of the
    hidden states routed to it over 448, its down input scale that of act(gate) * up (float weights)."""
    ref, model, calib, _ = _quantize("fp8-tensor-static")
    fe, q = ref.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    amax = {"gate_up": torch.zeros(fe.num_experts), "down": torch.zeros(fe.num_experts)}
    for x, idx, _ in _capture(fe, ref, calib):
        for e in range(fe.num_experts):
            xe = x[(idx == e).any(-1)]
            if not len(xe):
                continue
            g, u = torch.nn.functional.linear(xe, fe.gate_up_proj[e]).chunk(2, -1)
            amax["gate_up"][e] = max(amax["gate_up"][e], xe.abs().max())
            amax["down"][e] = max(amax["down"][e], (fe.act_fn(g) * u).abs().max())
    for p in ("gate_up", "down"):
        assert torch.equal(getattr(q, f"{p}_input_scale").reshape(-1), amax[p] / 448), p


@pytest.mark.parametrize("key,family", [("fp8-tensor-static", "mixtral"), ("fp8-channel-dynamic", "qwen2_moe"),
                                        ("mxfp4", "olmoe"), ("fp8-tensor-static", "gpt_oss"), ("mxfp8", "gpt_oss")])
def test_forward_equals_a_per_token_loop_over_the_experts_linears(key, family):
    """The experts' output equals, token by token, sum_j w_j * down_e(act(gate_up_e(x))) with the per-expert
    FP8Linear / MXLinear modules (``expert_linear``: they quantize their inputs as the scheme says); gpt-oss
    adds the biases and its clamped GLU. Tolerance 1e-5: one-row GEMMs against the module's batched ones."""
    _, model, calib, _ = _quantize(key, family)
    q = model.model.layers[1].mlp.experts
    (x, idx, w), = _capture(q, model, calib[:1])
    lin = {(p, e): q.expert_linear(p, e) for p in ("gate_up", "down") for e in range(q.num_experts)}
    assert all(isinstance(m, (FP8Linear, MXLinear)) for m in lin.values())
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = lin[("gate_up", e)](x[t:t + 1])
            if q.gpt_oss:
                h = h + q.gate_up_proj_bias[e]
                gate, up = h[..., 0::2].clamp(max=q._hf_shell.limit), h[..., 1::2].clamp(-q._hf_shell.limit,
                                                                                            q._hf_shell.limit)
                y = lin[("down", e)]((up + 1) * gate * torch.sigmoid(gate * q._hf_shell.alpha)) + q.down_proj_bias[e]
            else:
                gate, up = h.chunk(2, -1)
                y = lin[("down", e)](q.act_fn(gate) * up)
            want[t] += w[t, j] * y[0]
    with torch.no_grad():
        got = q(x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_weights_only_forward_is_the_hf_module_on_the_dequantized_weights_bit_for_bit():
    ref, model, calib, _ = _quantize("mxfp4-w4a16")
    q = model.model.layers[0].mlp.experts
    f = copy.deepcopy(ref.model.layers[0].mlp.experts)
    gu, dn = q.dequantized()
    with torch.no_grad():
        f.gate_up_proj.copy_(gu)
        f.down_proj.copy_(dn)
    (x, idx, w), = _capture(q, model, calib[:1])
    with torch.no_grad():
        assert torch.equal(q(x, idx, w), f(x, idx, w))


def test_one_weight_scale_for_all_experts_and_refusals():
    _, model, _, _ = _quantize("fp8-tensor-static", outer="tensor")
    q = model.model.layers[0].mlp.experts
    for p in ("gate_up", "down"):
        s = getattr(q, f"{p}_weight_scale").reshape(-1)
        assert torch.equal(s, s[:1].expand_as(s))
    with pytest.raises(QuantizationError, match="expert_outer_scale='tensor'.*fp8-w8a8.*per row or per block"):
        _quantize("fp8-channel-dynamic", outer="tensor")
    with pytest.raises(QuantizationError, match=r"mlp\.experts: intermediate size 64 is not a multiple of 128"):
        _quantize("fp8-block", family="qwen3_moe")
    m = tiny_moe("qwen3_moe")
    rep = quantize_model(m, PTQConfig(recipe=_recipe(SCHEMES["fp8-block"]), skip_indivisible=True, allow_partial=True),
                         _calib(), progress=False)
    assert not rep.experts and any("kept in high precision" in w for w in rep.warnings)


def test_gptq_on_fp8_experts_beats_rtn_per_expert():
    _, model, _, report = _quantize("fp8-channel-dynamic", method="gptq")
    assert isinstance(model.model.layers[0].mlp.experts, SchemeExperts)
    for r in report.experts:
        for p in ("gate_up", "down"):
            pairs = [(a, b) for a, b in zip(r.output_rel_err[p], r.rtn_output_rel_err[p]) if a is not None]
            assert pairs and all(a <= b * (1 + 1e-6) for a, b in pairs), (r.name, p)


# what vLLM's MoE methods read per expert from a checkpoint (each expert's gate / up / down as a Linear; the
# FusedMoE weight_loader stacks them into w13_* / w2_*): vllm/model_executor/layers/quantization/
# compressed_tensors/compressed_tensors_moe.py CompressedTensorsW8A8Fp8MoEMethod.create_weights (w13_weight_scale
# [E, 2] per tensor, [E, 2I, 1] per channel, [E, 2*ceil(I/128), ceil(H/128)] per 128-block; w13_input_scale [E]
# for static activations) and CompressedTensorsW4A4Mxfp4MoEMethod.create_weights (w13_weight_packed uint8
# [E, 2I, H/2], w13_weight_scale uint8 [E, 2I, H/32]); modelopt.py ModelOptFp8MoEMethod (per-tensor FP8).
# key -> suffix -> (dtype, per-expert gate / up shape as a function of (I, H))
ENGINE_TENSORS = {
    "fp8-tensor-static": {"weight": (torch.float8_e4m3fn, lambda I, H: (I, H)),
                          "weight_scale": (torch.float32, lambda I, H: (1,)),
                          "input_scale": (torch.float32, lambda I, H: (1,))},
    "fp8-channel-dynamic": {"weight": (torch.float8_e4m3fn, lambda I, H: (I, H)),
                            "weight_scale": (torch.float32, lambda I, H: (I, 1))},
    "fp8-block": {"weight": (torch.float8_e4m3fn, lambda I, H: (I, H)),
                  "weight_scale": (torch.float32, lambda I, H: (-(-I // 128), -(-H // 128)))},
    "mxfp4": {"weight_packed": (torch.uint8, lambda I, H: (I, H // 2)),
              "weight_scale": (torch.uint8, lambda I, H: (I, H // 32))},
}
MODELOPT_SCALAR = {"fp8-tensor-static"}  # ModelOpt writes per-tensor scales as FP32 scalars


@pytest.mark.parametrize("key,fmt,family", [("fp8-tensor-static", CT, "mixtral"), ("fp8-tensor-static", MO, "qwen2_moe"),
                                            ("fp8-channel-dynamic", CT, "qwen3_moe"), ("fp8-block", CT, "mixtral"),
                                            ("mxfp4", CT, "olmoe"), ("mxfp8", MO, "mixtral"),
                                            ("fp8-tensor-static", CT, "gpt_oss"), ("mxfp4-w4a16", CT, "gpt_oss")])
def test_export_names_shapes_and_reload_bit_for_bit(tmp_path, key, fmt, family):
    _, model, calib, _ = _quantize(key, family)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    tensors = load_file(out / "model.safetensors")
    q = model.model.layers[0].mlp.experts
    I, H = q.intermediate_dim, q.hidden_dim
    hub = "model.layers.0.block_sparse_moe.experts" if family == "mixtral" else "model.layers.0.mlp.experts"
    leaves = {"mixtral": ("w1", "w3", "w2"), "gpt_oss": ("gate_up_proj", None, "down_proj")}.get(
        family, ("gate_proj", "up_proj", "down_proj"))
    for e in range(q.num_experts):
        names = {k.rpartition(".")[2] for k in tensors if k.startswith(f"{hub}.{e}.{leaves[2]}.")}
        assert names, f"{hub}.{e}.{leaves[2]}"
        if key in ENGINE_TENSORS and family != "gpt_oss":
            for leaf in (leaves[0], leaves[1]):
                got = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(f"{hub}.{e}.{leaf}.")}
                assert set(got) == set(ENGINE_TENSORS[key]), (leaf, sorted(got))
                for suf, (dt, shape) in ENGINE_TENSORS[key].items():
                    want = () if fmt == MO and key in MODELOPT_SCALAR and suf != "weight" else shape(I, H)
                    assert got[suf].dtype == dt and tuple(got[suf].shape) == tuple(want), (leaf, suf, got[suf].shape)
            if key == "fp8-tensor-static":  # one GEMM, one scale: equal for gate and up of the expert
                for suf in ("weight_scale", "input_scale"):
                    assert torch.equal(tensors[f"{hub}.{e}.{leaves[0]}.{suf}"], tensors[f"{hub}.{e}.{leaves[1]}.{suf}"])
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors)  # no fused 3-D tensor
    if family == "gpt_oss":  # its biases as they are, in the model dtype
        assert tensors[f"{hub}.gate_up_proj_bias"].shape == (q.num_experts, 2 * I)
    back = load_checkpoint(out)
    assert isinstance(back.model.layers[0].mlp.experts, SchemeExperts)
    with torch.no_grad():
        assert torch.equal(back(calib).logits, model(calib).logits)


def test_mixed_recipe_nvfp4_attention_fp8_experts_round_trip(tmp_path):
    """The write-ups' mixed form the other way round (experts FP8, attention NVFP4 W4A4): one checkpoint with two
    config groups; the experts' per-expert Linears in the FP8 group; reload equal bit for bit."""
    model = tiny_moe("mixtral")
    recipe = PTQRecipe(default=Scheme("nvfp4-w4a4"), rules=(PTQRule("experts", SCHEMES["fp8-tensor-static"]),))
    calib = _calib()
    quantize_model(model, PTQConfig(recipe=recipe), calib, progress=False)
    out = export_checkpoint(model, tmp_path / "ck", CT)
    import json
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = list(qcfg["config_groups"].values())
    fp8 = [g for g in groups if g["weights"]["num_bits"] == 8]
    assert len(groups) == 2 and len(fp8) == 1
    assert "model.layers.0.block_sparse_moe.experts.3.w2" in fp8[0]["targets"]
    assert "model.layers.0.self_attn.q_proj" not in fp8[0]["targets"]
    back = load_checkpoint(out)
    with torch.no_grad():
        assert torch.equal(back(calib).logits, model(calib).logits)


def test_unequal_gate_and_up_scales_are_refused_on_load(tmp_path):
    from safetensors.torch import save_file

    from blockscale.errors import CheckpointError

    _, model, _, _ = _quantize("fp8-tensor-static")
    out = export_checkpoint(model, tmp_path / "ck", CT)
    t = load_file(out / "model.safetensors")
    k = "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
    t[k] = t[k] * 2
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"expert 2: gate .*w1\.weight_scale.* and up .*differ"):
        load_checkpoint(out, verify=False)


def test_fp8_spec_of_each_granularity_is_what_the_scheme_says():
    """The QuantizedTensor specs the experts hold: FP8 per tensor / per channel / 128x128 tiles, MX per 32."""
    specs = {}
    for key in ("fp8-tensor-static", "fp8-channel-dynamic", "mxfp4"):
        _, model, _, _ = _quantize(key)
        specs[key] = model.model.layers[0].mlp.experts.quantized_weight("down", 0).spec
    assert specs["fp8-tensor-static"] == FP8("e4m3", "tensor")
    assert specs["fp8-channel-dynamic"] == FP8("e4m3", "channel")
    assert isinstance(specs["mxfp4"], MX) and specs["mxfp4"].element == "e2m1"


@pytest.mark.parametrize("key,family", [("nvfp4-w4a4", "mixtral"), ("nvfp4-w4a16", "gpt_oss"),
                                        ("fp8-tensor-static", "qwen3_moe"), ("mxfp4-w4a16", "gpt_oss")])
def test_casting_the_model_to_bfloat16_keeps_codes_and_scales(key, family):
    """model.to(torch.bfloat16) casts only what is in the model dtype (gpt-oss biases, Linear biases, norms):
    NVFP4Linear / NVFP4Experts / SchemeExperts codes and scales keep their dtype and bytes (before, NVFP4
    block scales became bf16 and the forward failed), and the bf16 model runs, close to the fp32 one."""
    model, calib = _model(key, family), _calib()
    scheme = SCHEMES[key] if key in SCHEMES else Scheme(key)
    quantize_model(model, PTQConfig(recipe=PTQRecipe(default=scheme)), calib, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items() if v.dtype in (torch.uint8, torch.float8_e4m3fn)}
    with torch.no_grad():
        ref = model(calib).logits
    ex = model.model.layers[0].mlp.experts
    w32 = [w.clone() for w in ex.dequantized(torch.float32)]
    model.to(torch.bfloat16)
    after = model.state_dict()
    assert before and all(after[k].dtype == v.dtype and torch.equal(after[k].view(torch.uint8), v.view(torch.uint8))
                          for k, v in before.items())
    scales = [k for k in after if k.endswith(("global_scale", "weight_scale", "input_scale"))
              and after[k].dtype not in (torch.uint8, torch.float8_e4m3fn)]
    assert (scales or key.startswith("mx")) and all(after[k].dtype == torch.float32 for k in scales)  # MX: UE8M0
    if family == "gpt_oss":
        assert model.model.layers[0].mlp.experts.gate_up_proj_bias.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(calib).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(ex.dequantized(torch.bfloat16), w32))
    if family != "gpt_oss":  # (the tiny gpt-oss's x20 expert weights and clamp flip routes in bf16)
        torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
