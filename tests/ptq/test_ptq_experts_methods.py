"""PTQ methods on MoE experts: GPTQ (and 4/6-aware GPTQ) on fused 3-D experts with one Hessian per expert and
projection from the tokens routed to it, ``calibrate_all_experts`` (every token through every expert for
statistics only; fused experts and the transformers-4 per-expert nn.Linear layout), ``expert_outer_scale``
"tensor", unrouted experts (RTN, finite scales, a note), the config / report / CLI fields."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.errors import UsageError
from blockscale.nn import NVFP4Experts, NVFP4Linear
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.ptq.fused_experts import experts_summary, observe_experts
from blockscale.ptq.methods.gptq import GPTQOptions, gptq_quantize
from blockscale.ptq.statistics import HessianAccumulator, StatisticsRequest
from blockscale.quant.nvfp4 import outer_scale

transformers = pytest.importorskip("transformers")
from tiny_models import token_ids  # noqa: E402
from tiny_moe import E, I, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N_CALIB, T_CALIB, BATCH = 4, 16, 2


def _hybrid(float_model, quantized, i):
    """float_model with layers < i replaced by the quantized ones: what calibration feeds layer i."""
    hybrid = copy.deepcopy(float_model).requires_grad_(False)
    for j in range(i):
        hybrid.model.layers[j] = copy.deepcopy(quantized.model.layers[j])
    return hybrid


def _expert_hessians(float_model, quantized, i, calib, calibrate_all=False):
    """By hand, per expert e of layer i: the Hessians of its gate/up input (the hidden states routed to it,
    by top-k slot then token as the transformers eager loop takes them; every token with calibrate_all)
    and of its down input act(gate) * up, one chunk per calibration batch."""
    hybrid = _hybrid(float_model, quantized, i)
    experts = hybrid.model.layers[i].mlp.experts
    Hs = {"gate_up": [HessianAccumulator(experts.gate_up_proj.shape[-1]) for _ in range(E)],
          "down": [HessianAccumulator(I) for _ in range(E)]}
    routed = [0] * E

    def hook(mod, args):
        x, idx = args[0], args[1]
        for e in range(E):
            slot, tok = torch.where((idx == e).T)  # [top_k, tokens] row-major: slot first, then token
            routed[e] += tok.numel()
            xe = x if calibrate_all else x[tok]
            gate, up = torch.nn.functional.linear(xe, experts.gate_up_proj[e]).chunk(2, dim=-1)
            Hs["gate_up"][e].add(xe)
            Hs["down"][e].add(torch.nn.functional.silu(gate) * up)

    h = experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for ids in calib.split(BATCH):
            hybrid(input_ids=ids, use_cache=False)
    h.remove()
    return Hs, routed, experts


def _assert_same(q, want):
    assert torch.equal(q.codes, want.codes)
    assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))


def _check_gptq_experts(float_model, model, calib, spec, opts, calibrate_all=False):
    """Every expert of every layer equals gptq_quantize on its by-hand Hessian with its own outer scale."""
    for i in range(2):
        Hs, routed, fexperts = _expert_hessians(float_model, model, i, calib, calibrate_all)
        q = model.model.layers[i].mlp.experts
        assert isinstance(q, NVFP4Experts)
        gu, dn = fexperts.gate_up_proj.detach(), fexperts.down_proj.detach()
        for e in range(E):
            S = outer_scale(torch.maximum(gu[e, :I].abs().max(), gu[e, I:].abs().max()), spec.outer_bound)
            want, _ = gptq_quantize(gu[e], Hs["gate_up"][e].H, spec, S, opts)
            _assert_same(q.quantized_weight("gate_up", e), want)
            assert torch.equal(q.gate_up_weight_global_scale[e], S)
            S = outer_scale(dn[e].abs().max(), spec.outer_bound)
            want, _ = gptq_quantize(dn[e], Hs["down"][e].H, spec, S, opts)
            _assert_same(q.quantized_weight("down", e), want)
            # GPTQ is not RTN here (the Hessians are not diagonal)
            assert not torch.equal(q.down_weight_packed[e], bs.quantize(dn[e], spec, encode_scale=S).codes)
    return routed


@pytest.mark.parametrize("family,rule", [("mixtral", "6"), ("mixtral", "4over6"), ("qwen2_moe", "6")])
def test_gptq_per_expert_equals_gptq_on_its_routed_hessian(family, rule):
    model = tiny_moe(family)
    ref = copy.deepcopy(model)
    calib = token_ids(N_CALIB, T_CALIB)
    opts = GPTQOptions(block_size=32)  # 4over6: four_over_six="aware" (the default)
    rep = quantize_model(model, PTQConfig(method="gptq", scale_rule=rule, batch_size=BATCH, options=opts), calib,
                         progress=False)
    spec = bs.NVFP4(scale_rule=rule)
    _check_gptq_experts(ref, model, calib, spec, opts)
    for r in rep.experts:
        assert r.tokens == r.routed_tokens and sum(r.tokens) == calib.numel() * 2 and min(r.tokens) > 0
        assert r.outer_scale == "expert" and r.note == ""
        for p in ("gate_up", "down"):
            assert all(v is not None and v >= 0 for v in r.output_rel_err[p])
            # GPTQ's output error on the calibration Hessian is below RTN's with the same S, per expert
            assert sum(r.output_rel_err[p]) < sum(r.rtn_output_rel_err[p])
    assert all(isinstance(m, NVFP4Linear) for n, m in model.named_modules() if n.endswith("self_attn.q_proj"))


def test_calibrate_all_gives_every_expert_every_token_and_keeps_layer_outputs():
    # the hook's own pass: the fused module's output is the routed one, bit for bit
    model = tiny_moe("mixtral")
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(3)
    x, idx, w = torch.randn(12, 64), torch.stack([torch.randperm(E)[:2] for _ in range(12)]), torch.rand(12, 2)
    with torch.no_grad():
        plain = experts(x, idx, w)
        with observe_experts({"x": experts}, 0, 12, "cpu", StatisticsRequest(hessian=True), True) as ex:
            seen = experts(x, idx, w)
    assert torch.equal(seen, plain)
    assert ex["x"].tokens() == [12] * E and ex["x"].routed == [int((idx == e).sum()) for e in range(E)]
    assert all(s.hessian.n_tokens == 12 for s in ex["x"].stats["down"])
    # end to end: every expert's Hessian from every token; layer 1's inputs are the routed layer 0's
    # outputs (the by-hand reference runs the unhooked quantized layer 0)
    ref = copy.deepcopy(model)
    calib = token_ids(N_CALIB, T_CALIB)
    opts = GPTQOptions(block_size=32)
    cfg = PTQConfig(method="gptq", calibrate_all_experts=True, batch_size=BATCH, options=opts)
    rep = quantize_model(model, cfg, calib, progress=False)
    routed = _check_gptq_experts(ref, model, calib, bs.NVFP4(), opts, calibrate_all=True)
    for r in rep.experts:
        assert r.tokens == [calib.numel()] * E
        assert sum(r.routed_tokens) == 2 * calib.numel() and r.routed_tokens != r.tokens
    assert rep.experts[1].routed_tokens == routed
    assert rep.config["calibrate_all_experts"] is True and "expert_outer_scale" not in rep.config
    assert "calibrate_all_experts" in experts_summary(rep.experts)


def _never_route_expert_3(model):
    with torch.no_grad():  # top-1 routing never picks expert 3: max(v.h, -v.h) >= 0 = its logit
        for layer in model.model.layers:
            g = layer.mlp.gate.weight
            g[1] = -g[0]
            g[3] = 0


def test_gptq_unrouted_expert_is_rtn_with_finite_scales_and_a_note():
    model = tiny_moe("mixtral", top_k=1)
    _never_route_expert_3(model)
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match="no calibration tokens routed to expert"):
        rep = quantize_model(model, PTQConfig(method="gptq", activations="w4a4"), token_ids(N_CALIB, T_CALIB),
                             progress=False)
    spec = bs.NVFP4()
    for i, r in enumerate(rep.experts):
        assert r.tokens[3] == 0 and r.routed_tokens[3] == 0 and sum(r.tokens) == N_CALIB * T_CALIB
        assert "expert(s) [3]: RTN weights" in r.note
        assert any(w.startswith(f"model.layers.{i}.mlp.experts: no calibration tokens") for w in rep.warnings)
        assert r.output_rel_err["gate_up"][3] is None and r.output_rel_err["gate_up"][0] is not None
        q = model.model.layers[i].mlp.experts
        for b in (q.gate_up_input_global_scale, q.down_input_global_scale, q.gate_up_weight_global_scale,
                  q.down_weight_global_scale):
            assert torch.isfinite(b).all() and (b > 0).all()
        assert all(torch.isfinite(t).all() for t in q.dequantized())
        fe = ref.model.layers[i].mlp.experts  # the unrouted expert: RTN with its own outer scale
        S = outer_scale(fe.gate_up_proj[3].abs().max(), spec.outer_bound)
        _assert_same(q.quantized_weight("gate_up", 3), bs.quantize(fe.gate_up_proj[3].detach(), spec, encode_scale=S))
    with torch.no_grad():
        assert torch.isfinite(model(token_ids(2, 16)).logits).all()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_tensor_outer_scale_is_one_per_projection_for_all_experts(method):
    model = tiny_moe("qwen3_moe")
    ref = copy.deepcopy(model)
    cfg = PTQConfig(method=method, scale_rule="4over6", expert_outer_scale="tensor")
    rep = quantize_model(model, cfg, token_ids(N_CALIB, T_CALIB), progress=False)
    spec = bs.NVFP4(scale_rule="4over6")
    for i in range(2):
        q, fe = model.model.layers[i].mlp.experts, ref.model.layers[i].mlp.experts
        S_gu = outer_scale(fe.gate_up_proj.abs().max(), spec.outer_bound)  # over every expert's gate and up rows
        S_dn = outer_scale(fe.down_proj.abs().max(), spec.outer_bound)
        assert torch.equal(q.gate_up_weight_global_scale, S_gu.expand(E))
        assert torch.equal(q.down_weight_global_scale, S_dn.expand(E))
        if method == "rtn":
            for e in range(E):
                _assert_same(q.quantized_weight("gate_up", e),
                             bs.quantize(fe.gate_up_proj[e].detach(), spec, encode_scale=S_gu))
                _assert_same(q.quantized_weight("down", e),
                             bs.quantize(fe.down_proj[e].detach(), spec, encode_scale=S_dn))
    assert all(r.outer_scale == "tensor" for r in rep.experts)
    assert rep.config["expert_outer_scale"] == "tensor" and "calibrate_all_experts" not in rep.config
    assert "outer scale per tensor" in experts_summary(rep.experts)


def test_config_fields_and_defaults():
    d = PTQConfig().to_dict()
    assert "calibrate_all_experts" not in d and "expert_outer_scale" not in d  # dense digests unchanged
    assert PTQConfig(calibrate_all_experts=True).to_dict()["calibrate_all_experts"] is True
    assert PTQConfig().label == "rtn 6 w4a16"
    assert PTQConfig(method="gptq", expert_outer_scale="tensor", calibrate_all_experts=True).label == \
        "gptq 6 w4a16 experts:tensor calibrate-all-experts"
    with pytest.raises(UsageError, match=r"expert_outer_scale='layer' is not supported; allowed values: 'expert', "
                                         r"'tensor'"):
        PTQConfig(expert_outer_scale="layer")
    with pytest.raises(UsageError, match=r"calibrate_all_experts=1: expected True or False"):
        PTQConfig(calibrate_all_experts=1)


def test_cli_flags_reach_the_config_and_the_summary(tmp_path, capsys):
    import json

    from blockscale import cli
    from blockscale.cli.main import build_parser

    args = build_parser().parse_args(["quantize", "m", "--out", "o", "--calibrate-all-experts",
                                      "--expert-outer-scale", "tensor"])
    assert args.calibrate_all_experts is True and args.expert_outer_scale == "tensor"
    args = build_parser().parse_args(["quantize", "m", "--out", "o"])
    assert args.calibrate_all_experts is False and args.expert_outer_scale == "expert"
    tiny_moe("mixtral").save_pretrained(tmp_path / "mix")  # no tokenizer: RTN W4A16
    assert cli.main(["quantize", str(tmp_path / "mix"), "--expert-outer-scale", "tensor",
                     "--out", str(tmp_path / "q")]) == 0
    assert "quantized 2 fused-experts modules (8 experts; outer scale per tensor)" in capsys.readouterr().out
    report = json.loads((tmp_path / "q" / "ptq_report.json").read_text())["ptq"]
    assert report["config"]["expert_outer_scale"] == "tensor"
    assert [r["outer_scale"] for r in report["experts"]] == ["tensor", "tensor"]
    q = bs.load_checkpoint(tmp_path / "q").model.layers[0].mlp.experts
    assert len(set(q.gate_up_weight_global_scale.tolist())) == 1 and len(set(q.down_weight_global_scale.tolist())) == 1
    with pytest.raises(SystemExit):
        cli.main(["quantize", str(tmp_path / "mix"), "--expert-outer-scale", "layer", "--out", str(tmp_path / "r")])
    assert "invalid choice: 'layer'" in capsys.readouterr().err


# -- the transformers-4 layout: a ModuleList of expert MLPs of nn.Linear ------------------------------------
class Top2MLP(nn.Module):
    """transformers 4's MixtralBlockSparseTop2MLP: w2(act(w1 x) * w3 x)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act):
        super().__init__()
        inter, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(gate_up[:inter])
            self.w3.weight.copy_(gate_up[inter:])
            self.w2.weight.copy_(down)
        self.act_fn = act

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class ExpertList(nn.ModuleList):
    """The per-expert layout with the fused module's forward(hidden_states, top_k_index, top_k_weights)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            slot, tok = torch.where((top_k_index == e).T)
            if tok.numel():
                out.index_add_(0, tok, expert(hidden_states[tok]) * top_k_weights[tok, slot, None])
        return out


def _per_expert_linears(model):
    for layer in model.model.layers:
        f = layer.mlp.experts
        layer.mlp.experts = ExpertList([Top2MLP(f.gate_up_proj[e].detach(), f.down_proj[e].detach(), f.act_fn)
                                        for e in range(E)])
    return model


def _linear_hessians(float_model, quantized, i, calib, calibrate_all):
    """By hand, per expert of layer i: Hessians of w1/w3's input and w2's, one chunk per batch."""
    hybrid = _hybrid(float_model, quantized, i)
    block = hybrid.model.layers[i].mlp
    Hs = {k: [HessianAccumulator(64 if k == "w1" else I) for _ in range(E)] for k in ("w1", "w2")}
    seen = []
    hooks = [block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].reshape(-1, 64))),
             block.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))]
    with torch.no_grad():
        for ids in calib.split(BATCH):
            hybrid(input_ids=ids, use_cache=False)
            x, idx = seen.pop(0), seen.pop(0)
            for e, ex in enumerate(block.experts):
                xe = x if calibrate_all else x[torch.where((idx == e).T)[1]]
                Hs["w1"][e].add(xe)
                Hs["w2"][e].add(torch.nn.functional.silu(xe @ ex.w1.weight.T) * (xe @ ex.w3.weight.T))
    for h in hooks:
        h.remove()
    return Hs, block.experts


@pytest.mark.parametrize("calibrate_all", [False, True])
def test_per_expert_linear_layout_gptq_and_calibrate_all(calibrate_all):
    model = tiny_moe("mixtral")
    ids = token_ids(2, 16)
    with torch.no_grad():
        fused_logits = model(ids).logits
        _per_expert_linears(model)
        torch.testing.assert_close(model(ids).logits, fused_logits, rtol=1e-5, atol=1e-5)  # the same model
    ref = copy.deepcopy(model)
    calib = token_ids(N_CALIB, T_CALIB)
    opts = GPTQOptions(block_size=32)
    cfg = PTQConfig(method="gptq", calibrate_all_experts=calibrate_all, batch_size=BATCH, options=opts)
    rep = quantize_model(model, cfg, calib, progress=False)
    lin = {r.name: r for r in rep.linears}
    spec = bs.NVFP4()
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        tokens = [lin[f"{p}.{e}.w1"].tokens for e in range(E)]
        if calibrate_all:  # every token once: not the routed calls as well
            assert tokens == [calib.numel()] * E
        else:
            assert sum(tokens) == 2 * calib.numel() and min(tokens) > 0
        assert all(lin[f"{p}.{e}.w2"].tokens == tokens[e] == lin[f"{p}.{e}.w3"].tokens for e in range(E))
        Hs, fexperts = _linear_hessians(ref, model, i, calib, calibrate_all)
        for e, ex in enumerate(fexperts):
            qe = model.model.layers[i].mlp.experts[e]
            assert isinstance(qe.w1, NVFP4Linear) and isinstance(qe.w2, NVFP4Linear)
            S = outer_scale(torch.maximum(ex.w1.weight.abs().max(), ex.w3.weight.abs().max()), spec.outer_bound)
            for k, w, H in (("w1", ex.w1.weight, Hs["w1"][e]), ("w3", ex.w3.weight, Hs["w1"][e])):
                want, _ = gptq_quantize(w.detach(), H.H, spec, S, opts)
                assert torch.equal(getattr(qe, k).dequantized_weight(torch.float32), want.dequantize(torch.float32))
            S = outer_scale(ex.w2.weight.abs().max(), spec.outer_bound)
            want, _ = gptq_quantize(ex.w2.weight.detach(), Hs["w2"][e].H, spec, S, opts)
            assert torch.equal(qe.w2.dequantized_weight(torch.float32), want.dequantize(torch.float32))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_per_expert_linear_layout_tensor_outer_scale():
    """expert_outer_scale="tensor" on the per-expert nn.Linear layout: one outer scale over every expert's
    w1/w3, one over every w2 (RTN weights equal bs.quantize with it); "expert" keeps one per expert."""
    model = _per_expert_linears(tiny_moe("mixtral"))
    ref = copy.deepcopy(model)
    per_expert = copy.deepcopy(model)
    quantize_model(model, PTQConfig(expert_outer_scale="tensor"), progress=False)
    quantize_model(per_expert, PTQConfig(), progress=False)
    spec = bs.NVFP4()
    for i in range(2):
        fe, q, qe = (m.model.layers[i].mlp.experts for m in (ref, model, per_expert))
        S_gu = outer_scale(torch.stack([torch.maximum(ex.w1.weight.abs().max(), ex.w3.weight.abs().max())
                                        for ex in fe]).max(), spec.outer_bound)
        S_dn = outer_scale(torch.stack([ex.w2.weight.abs().max() for ex in fe]).max(), spec.outer_bound)
        for e in range(E):
            for k, S in (("w1", S_gu), ("w3", S_gu), ("w2", S_dn)):
                want = bs.quantize(getattr(fe[e], k).weight.detach(), spec, encode_scale=S)
                assert torch.equal(getattr(q[e], k).dequantized_weight(torch.float32), want.dequantize(torch.float32))
        per = {float(getattr(qe[e], k).weight_global_scale) for e in range(E) for k in ("w1", "w2")}
        assert len(per) > 2  # the default really is per expert, so the check above can fail
