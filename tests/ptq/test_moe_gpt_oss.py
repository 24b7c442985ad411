"""gpt-oss experts (transformers GptOssExperts: gate_up_proj [E, H, 2I] transposed, gate / up interleaved in the
last dim, biases, clamped GLU) through PTQ (RTN, GPTQ per expert), export and blockscale.load
(``nn.nvfp4_gpt_oss_experts.NVFP4GptOssExperts``). References are written here by hand: E2M1 decoding of the
packed codes, the clamped GLU on interleaved columns, per-expert routing."""
import copy

import pytest
import torch
from safetensors.torch import load_file

import blockscale as bs
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.nn import NVFP4Linear
from blockscale.nn.nvfp4_gpt_oss_experts import NVFP4GptOssExperts
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.methods.gptq import GPTQOptions, gptq_quantize
from blockscale.ptq.statistics import HessianAccumulator
from blockscale.quant import fake_quantize
from blockscale.quant.nvfp4 import outer_scale

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, H, I, TOPK, gpt_oss_glu, tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 2
CT, MO = "compressed-tensors", "modelopt"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _decode(packed: torch.Tensor, scales: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """By hand: E2M1 codes (element 2i in the low nibble, sign bit 3) times the E4M3 block scale, times 1/S."""
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    nib = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    q = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
    s = scales.float().repeat_interleave(16, dim=-1)
    return (q * s) * (1.0 / S)


def _reference(model, quantized):
    """``quantized`` with every NVFP4GptOssExperts replaced by ``model``'s GptOssExperts holding the by-hand
    dequantized weights (and the stored biases)."""
    ref = copy.deepcopy(quantized)
    for lf, lq in zip(model.model.layers, ref.model.layers):
        ex, q = copy.deepcopy(lf.mlp.experts), lq.mlp.experts
        lq.mlp.experts = ex
        gu = torch.stack([_decode(q.gate_up_weight_packed[e], q.gate_up_weight_scale[e],
                                  q.gate_up_weight_global_scale[e]) for e in range(E)])  # [E, 2I, H]
        dn = torch.stack([_decode(q.down_weight_packed[e], q.down_weight_scale[e], q.down_weight_global_scale[e])
                          for e in range(E)])  # [E, H, I]
        with torch.no_grad():
            ex.gate_up_proj.copy_(gu.transpose(1, 2))
            ex.down_proj.copy_(dn.transpose(1, 2))
            ex.gate_up_proj_bias.copy_(q.gate_up_proj_bias)
            ex.down_proj_bias.copy_(q.down_proj_bias)
    return ref


def test_w4a16_forward_equals_the_hf_module_on_by_hand_dequantized_weights():
    model = tiny_gpt_oss()
    fl = copy.deepcopy(model)
    calib = token_ids(4, 16)
    quantize_model(model, PTQConfig(), progress=False)
    for lf, lq in zip(fl.model.layers, model.model.layers):
        q, ex = lq.mlp.experts, lf.mlp.experts
        assert isinstance(q, NVFP4GptOssExperts) and q.scheme_name == "nvfp4-w4a16"
        assert torch.equal(q.gate_up_proj_bias, ex.gate_up_proj_bias)
        assert torch.equal(q.down_proj_bias, ex.down_proj_bias)
        assert tuple(q.gate_up_weight_packed.shape) == (E, 2 * I, H // 2)
        for e in range(E):
            # stored rows are gate_up_proj[e]^T with gate / up interleaved as in the checkpoint: row 2j ~ gate j
            w = ex.gate_up_proj[e].detach().T
            deq = _decode(q.gate_up_weight_packed[e], q.gate_up_weight_scale[e], q.gate_up_weight_global_scale[e])
            assert ((deq - w).pow(2).sum() / w.pow(2).sum()) < 0.02
            swapped = torch.cat([w[0::2], w[1::2]])  # the de-interleaved order would not match
            assert ((deq - swapped).pow(2).sum() / swapped.pow(2).sum()) > 0.5
    ref = _reference(fl, model)
    ids = calib[:2]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        # and the experts module alone, on routed tokens
        x = torch.randn(10, H)
        idx = torch.stack([torch.randperm(E)[:TOPK] for _ in range(10)])
        w = torch.softmax(torch.randn(10, TOPK), -1)
        got = model.model.layers[1].mlp.experts(x, idx, w)
        assert torch.equal(got, ref.model.layers[1].mlp.experts(x, idx, w))


def test_gate_and_up_share_one_outer_scale_per_expert():
    model = tiny_gpt_oss()
    fl = copy.deepcopy(model)
    quantize_model(model, PTQConfig(), progress=False)
    for lf, lq in zip(fl.model.layers, model.model.layers):
        gu, dn = lf.mlp.experts.gate_up_proj.detach(), lf.mlp.experts.down_proj.detach()
        q = lq.mlp.experts
        for e in range(E):
            # one S for the expert's gate (columns ::2) and up (1::2) together: the amax of both
            amax = torch.maximum(gu[e][:, 0::2].abs().max(), gu[e][:, 1::2].abs().max())
            assert torch.equal(q.gate_up_weight_global_scale[e], outer_scale(amax))
            assert torch.equal(q.down_weight_global_scale[e], outer_scale(dn[e].abs().max()))
        assert len(set(q.gate_up_weight_global_scale.tolist())) == E  # per expert, not per module


def test_w4a4_forward_equals_a_by_hand_expert_loop():
    model = tiny_gpt_oss()
    quantize_model(model, PTQConfig(activations="w4a4"), token_ids(4, 16), progress=False)
    q = model.model.layers[0].mlp.experts
    assert q.scheme_name == "nvfp4-w4a4" and q.gate_up_input_global_scale.shape == (E,)
    gu, dn = q.dequantized()
    x = torch.randn(12, H)
    idx = torch.stack([torch.randperm(E)[:TOPK] for _ in range(12)])
    w = torch.softmax(torch.randn(12, TOPK), -1)
    spec = bs.NVFP4()
    want = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        order = torch.argsort(slot * 100 + tok, stable=True)  # the HF loop's order: by slot, then token
        tok, slot = tok[order], slot[order]
        xi = fake_quantize(x[tok], spec, encode_scale=q.gate_up_input_global_scale[e], check_finite=False)
        h = gpt_oss_glu(xi @ gu[e].T + q.gate_up_proj_bias[e], q._hf_shell.alpha, q._hf_shell.limit)
        h = fake_quantize(h, spec, encode_scale=q.down_input_global_scale[e], check_finite=False)
        want.index_add_(0, tok, (h @ dn[e].T + q.down_proj_bias[e]) * w[tok, slot, None])
    with torch.no_grad():
        got = q(x, idx, w)
    assert torch.equal(got, want)


def _expert_hessians(fl, quantized, i, calib):
    """By hand, per expert of layer i (layers < i quantized, as calibration feeds it): the Hessians of the
    hidden states routed to it and of the clamped GLU of its gate/up output (float weights and biases)."""
    hybrid = copy.deepcopy(fl)
    for j in range(i):
        hybrid.model.layers[j] = copy.deepcopy(quantized.model.layers[j])
    ex = hybrid.model.layers[i].mlp.experts
    Hs = {"gate_up": [HessianAccumulator(H) for _ in range(E)], "down": [HessianAccumulator(I) for _ in range(E)]}

    def hook(mod, args):
        x, idx = args[0], args[1]
        for e in range(E):
            _, tok = torch.where((idx == e).T)
            xe = x[tok]
            Hs["gate_up"][e].add(xe)
            Hs["down"][e].add(gpt_oss_glu(xe @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e], ex.alpha, ex.limit))

    h = ex.register_forward_pre_hook(hook)
    with torch.no_grad():
        for ids in calib.split(BATCH):
            hybrid(input_ids=ids, use_cache=False)
    h.remove()
    return Hs, ex


def test_gptq_per_expert_equals_gptq_on_its_routed_hessian():
    model = tiny_gpt_oss()
    fl = copy.deepcopy(model)
    calib = token_ids(4, 16)
    opts = GPTQOptions(block_size=32)
    rep = quantize_model(model, PTQConfig(method="gptq", batch_size=BATCH, options=opts), calib, progress=False)
    spec = bs.NVFP4()
    for i in range(2):
        Hs, ex = _expert_hessians(fl, model, i, calib)
        q = model.model.layers[i].mlp.experts
        gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
        for e in range(E):
            w = gu[e].T.contiguous()
            want, _ = gptq_quantize(w, Hs["gate_up"][e].H, spec, outer_scale(w.abs().max()), opts)
            got = q.quantized_weight("gate_up", e)
            assert torch.equal(got.codes, want.codes)
            assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
            w = dn[e].T.contiguous()
            want, _ = gptq_quantize(w, Hs["down"][e].H, spec, outer_scale(w.abs().max()), opts)
            assert torch.equal(q.quantized_weight("down", e).codes, want.codes)
            assert not torch.equal(want.codes, bs.quantize(w, spec, encode_scale=outer_scale(w.abs().max())).codes)
    for r in rep.experts:
        assert sum(r.tokens) == calib.numel() * TOPK and r.note == ""


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_smoothing_methods_quantize_gpt_oss_layers(method):
    """AWQ / SmoothQuant fold into gpt-oss layers (tests/ptq/test_smoothing_gpt_oss.py checks the folds); the
    experts' up -> down fold is impossible (clamped GLU), which the report says once."""
    from blockscale.ptq.smoothing.moe import GPT_OSS_DOWN_NOTE

    model = tiny_gpt_oss()
    rep = quantize_model(model, PTQConfig(method=method), token_ids(2, 8), progress=False)
    assert all(isinstance(layer.mlp.experts, NVFP4GptOssExperts) for layer in model.model.layers)
    assert [w for w in rep.warnings if "not smoothed" in w] == [f"model.layers.*.mlp.experts.{GPT_OSS_DOWN_NOTE}"]
    qkv = [lr for lr in rep.linears if lr.name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
    assert len(qkv) == 6 and all(lr.smoothing_alpha is not None for lr in qkv)  # o_proj: GQA, no v -> o group


@pytest.mark.parametrize("fmt,act", [(CT, "w4a16"), (CT, "w4a4"), (MO, "w4a16"), (MO, "w4a4")])
def test_export_names_and_reload_logits_bit_for_bit(tmp_path, fmt, act):
    model = tiny_gpt_oss()
    fl = copy.deepcopy(model)
    calib = token_ids(4, 16)
    quantize_model(model, PTQConfig(method="gptq", activations=act, batch_size=BATCH), calib, progress=False)
    out = export_checkpoint(model, tmp_path / "ck", fmt)
    t = load_file(str(out / "model.safetensors"))
    m = "model.layers.0.mlp.experts"
    q = model.model.layers[0].mlp.experts
    if fmt == CT:
        want = {"weight_packed": (torch.uint8, H // 2), "weight_scale": (torch.float8_e4m3fn, H // 16),
                "weight_global_scale": (torch.float32, None)} | (
            {"input_global_scale": (torch.float32, None)} if act == "w4a4" else {})
    else:
        want = {"weight": (torch.uint8, H // 2), "weight_scale": (torch.float8_e4m3fn, H // 16),
                "weight_scale_2": (torch.float32, None)} | (
            {"input_scale": (torch.float32, None)} if act == "w4a4" else {})
    expert_keys = {k for k in t if k.startswith(f"{m}.")}
    names = {f"{m}.{e}.{leaf}.{suf}" for e in range(E) for leaf in ("gate_up_proj", "down_proj") for suf in want}
    # per expert: one gate_up Linear [2I, H] (interleaved rows), one down Linear [H, I]; the biases as
    # save_pretrained writes them
    assert expert_keys == names | {f"{m}.gate_up_proj_bias", f"{m}.down_proj_bias"}
    for e in range(E):
        for leaf, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            for suf, (dt, cols) in want.items():
                x = t[f"{m}.{e}.{leaf}.{suf}"]
                assert x.dtype == dt
                if cols is not None:
                    assert tuple(x.shape) == (rows, k // 2 if "scale" not in suf else k // 16)
        if fmt == CT:  # the expert's one gate/up outer scale, as stored
            assert torch.equal(t[f"{m}.{e}.gate_up_proj.weight_global_scale"].reshape(()),
                               q.gate_up_weight_global_scale[e])
    fl.save_pretrained(str(tmp_path / "hub"))
    hub = load_file(str(tmp_path / "hub" / "model.safetensors"))
    for k in (f"{m}.gate_up_proj_bias", f"{m}.down_proj_bias"):
        assert torch.equal(t[k], hub[k]) and t[k].dtype == hub[k].dtype
    assert "model.layers.0.mlp.router.weight" in t
    r = load_checkpoint(out)
    rq = r.model.layers[0].mlp.experts
    assert isinstance(rq, NVFP4GptOssExperts) and rq.scheme_name == q.scheme_name
    for b in ("gate_up_weight_packed", "down_weight_scale", "gate_up_proj_bias", "down_proj_bias"):
        assert torch.equal(getattr(rq, b).view(torch.uint8), getattr(q, b).view(torch.uint8)), b
    for b in ("gate_up_weight_global_scale", "down_weight_global_scale"):  # ModelOpt stores fl(1/S)
        v, w = getattr(rq, b), getattr(q, b)
        assert torch.equal(v, w) if fmt == CT else torch.equal(1.0 / v, 1.0 / w), b
    assert isinstance(r.model.layers[0].self_attn.q_proj, NVFP4Linear)
    ids = calib[:2]
    with torch.no_grad():
        assert torch.equal(r(ids).logits, model(ids).logits)


def test_calibrate_all_and_tensor_outer_scale():
    model = tiny_gpt_oss()
    fl = copy.deepcopy(model)
    calib = token_ids(4, 16)
    rep = quantize_model(model, PTQConfig(activations="w4a4", calibrate_all_experts=True, expert_outer_scale="tensor"),
                         calib, progress=False)
    for r in rep.experts:
        assert r.tokens == [calib.numel()] * E and sum(r.routed_tokens) == calib.numel() * TOPK
        assert r.outer_scale == "tensor"
    for lf, lq in zip(fl.model.layers, model.model.layers):
        q = lq.mlp.experts
        assert torch.equal(q.gate_up_weight_global_scale,
                           outer_scale(lf.mlp.experts.gate_up_proj.detach().abs().max()).expand(E))
        assert torch.equal(q.down_weight_global_scale,
                           outer_scale(lf.mlp.experts.down_proj.detach().abs().max()).expand(E))


def test_scale_learning_starts_from_and_freezes_back_to_the_ptq_model():
    from blockscale import lsq

    model = tiny_gpt_oss()
    quantize_model(model, PTQConfig(), progress=False)
    ids = token_ids(2, 8)
    learned = copy.deepcopy(model)
    lsq.enable(learned)
    assert type(learned.model.layers[0].mlp.experts).__name__ == "LSQExperts"
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(learned(ids).logits, want)  # step 0: the PTQ model bit for bit
    lsq.freeze(learned)
    assert isinstance(learned.model.layers[0].mlp.experts, NVFP4GptOssExperts)
    with torch.no_grad():
        assert torch.equal(learned(ids).logits, want)
