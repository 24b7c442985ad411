"""One quantized experts module (``nn.quantized_experts.QuantizedExperts``) for every stored scheme and layout:
built from per-expert Linears it holds exactly their tensors (``expert_linear`` gives them back, row slices
included), the NVFP4 path through Linears equals the NVFP4Experts one through QuantizedTensors bit for bit, and
the layout adapters (``nn.experts_layouts``) say what each transformers experts class is."""
import pytest
import torch
from torch import nn

import blockscale as bs
from blockscale.nn import NVFP4Experts, NVFP4Linear, QuantizedExperts, SchemeExperts
from blockscale.nn.experts_layouts import EXPERTS_LAYOUTS, experts_layout_named, experts_layout_of
from blockscale.nn.fused_experts_layout import FUSED_LAYOUT
from blockscale.nn.gpt_oss_experts_layout import GPT_OSS_LAYOUT
from blockscale.nn.nvfp4_gpt_oss_experts import NVFP4GptOssExperts
from blockscale.nn.quantized_linear import QuantizedInferenceLinear
from blockscale.quant import FP8, MX, NVFP4

transformers = pytest.importorskip("transformers")
from tiny_moe import tiny_gpt_oss, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# (stored triple, rules, weight spec) of every inference Linear kind
STORED = {
    "nvfp4-w4a16": (("nvfp4", "nvfp4", None), {}, NVFP4()),
    "nvfp4-w4a4": (("nvfp4", "nvfp4", "nvfp4"), {"input_scale_rule": "4over6"}, NVFP4()),
    "fp8-tensor-static": (("fp8", "tensor", "tensor"), {}, FP8(granularity="tensor")),
    "fp8-channel": (("fp8", "channel", "token"), {}, FP8(granularity="channel")),
    "fp8-block": (("fp8", "block", "block"), {}, FP8(granularity="block")),
    "mxfp8": (("mx", "e4m3", "e4m3"), {"scale_rule": "ceil"}, MX(element="e4m3")),
    "mxfp4-w4a16": (("mx", "e2m1", None), {"scale_rule": "ceil"}, MX(element="e2m1")),
}


def _experts_module(family):
    model = tiny_gpt_oss() if family == "gpt_oss" else tiny_moe(family)
    return model.model.layers[0].mlp.experts


def _linears(module, key, seed=0):
    """Random per-expert Linears of ``module``'s out x in matrices under scheme ``key`` (gate and up of an expert
    sharing their per-tensor scale, input scales distinct per expert)."""
    stored, rules, spec = STORED[key]
    lay = experts_layout_of(module)
    gu, dn = lay.matrices(module)
    g = torch.Generator().manual_seed(seed)
    out = {"gate_up": [], "down": []}
    for p, W in (("gate_up", gu), ("down", dn)):
        for e in range(W.shape[0]):
            w = W[e] + 0.01 * torch.randn(W[e].shape, generator=g)
            lin = QuantizedInferenceLinear.class_for(stored[0]).empty(stored, w.shape[1], w.shape[0], rules=rules,
                                                                      dtype=w.dtype)
            lin.load_quantized(bs.quantize(w, spec))
            for b, t in lin.named_buffers(recurse=False):
                if b.startswith("input"):
                    t.fill_(0.5 + e + (p == "down"))
            out[p].append(lin)
    return out


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("key", list(STORED))
def test_built_from_linears_it_gives_them_back(family, key):
    module = _experts_module(family)
    lins = _linears(module, key)
    ex = QuantizedExperts.from_linears(module, lins["gate_up"], lins["down"])
    want = {"nvfp4": NVFP4GptOssExperts if family == "gpt_oss" else NVFP4Experts}.get(STORED[key][0][0], SchemeExperts)
    assert type(ex) is want and ex.stored == STORED[key][0] and ex.num_experts == len(lins["down"])
    assert ex.layout is (GPT_OSS_LAYOUT if family == "gpt_oss" else FUSED_LAYOUT)
    for p in ("gate_up", "down"):
        for e, src in enumerate(lins[p]):
            got = ex.expert_linear(p, e)
            assert type(got) is type(src)
            for b, t in src.named_buffers(recurse=False):
                assert torch.equal(getattr(got, b), t), (p, e, b)
            assert torch.equal(ex.quantized_weight(p, e).dequantize(), src.quantized_weight().dequantize())
            x = torch.randn(3, src.in_features)
            assert torch.equal(ex.quantize_input(x, p, e), src.quantize_input(x))
    if family == "gpt_oss":
        assert torch.equal(ex.gate_up_proj_bias, module.gate_up_proj_bias.detach())


@pytest.mark.parametrize("key", ["nvfp4-w4a4", "fp8-channel", "mxfp8"])
def test_row_slices_are_the_source_rows(key):
    module = _experts_module("mixtral")
    lins = _linears(module, key)
    ex = QuantizedExperts.from_linears(module, lins["gate_up"], lins["down"])
    I = ex.intermediate_dim
    for e, src in enumerate(lins["gate_up"]):
        full = src.dequantized_weight(torch.float32)
        for rows in (slice(0, I), slice(I, 2 * I)):
            part = ex.expert_linear("gate_up", e, rows)
            assert part.out_features == I and torch.equal(part.dequantized_weight(torch.float32), full[rows])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("w4a4", [False, True])
def test_nvfp4_through_linears_equals_through_quantized_tensors(family, w4a4):
    """The one construction path (PTQ and load: Linears) gives the buffers NVFP4Experts.from_experts gives."""
    module = _experts_module(family)
    key = "nvfp4-w4a4" if w4a4 else "nvfp4-w4a16"
    lins = _linears(module, key)
    via_linears = QuantizedExperts.from_linears(module, lins["gate_up"], lins["down"])
    kw = {}
    if w4a4:
        kw = dict(gate_up_input_scale=torch.cat([m.input_global_scale for m in lins["gate_up"]]),
                  down_input_scale=torch.cat([m.input_global_scale for m in lins["down"]]), input_scale_rule="4over6")
    cls = NVFP4GptOssExperts if family == "gpt_oss" else NVFP4Experts
    via_tensors = cls.from_experts(module, [m.quantized_weight() for m in lins["gate_up"]],
                                   [m.quantized_weight() for m in lins["down"]], **kw)
    a, b = via_linears.state_dict(), via_tensors.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert a["gate_up_weight_global_scale"].shape == (via_linears.num_experts,)  # NVFP4's [E] outer scales
    x = torch.randn(6, via_linears.hidden_dim)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    w = torch.rand(6, 2)
    with torch.no_grad():
        assert torch.equal(via_linears(x, idx, w), via_tensors(x, idx, w))


def test_layouts_claim_their_classes():
    mixtral, gpt_oss = _experts_module("mixtral"), _experts_module("gpt_oss")
    assert experts_layout_of(mixtral) is FUSED_LAYOUT and experts_layout_of(gpt_oss) is GPT_OSS_LAYOUT
    assert experts_layout_of(nn.Linear(4, 4)) is None
    assert FUSED_LAYOUT.dims(mixtral) == (mixtral.gate_up_proj.shape[0], mixtral.gate_up_proj.shape[2],
                                          mixtral.down_proj.shape[2])
    E, H, two_i = gpt_oss.gate_up_proj.shape
    assert GPT_OSS_LAYOUT.dims(gpt_oss) == (E, H, two_i // 2)
    gu, dn = GPT_OSS_LAYOUT.matrices(gpt_oss)
    assert torch.equal(gu[1], gpt_oss.gate_up_proj[1].detach().T) and torch.equal(dn[1], gpt_oss.down_proj[1].detach().T)
    with pytest.raises(ValueError, match="allowed values: 'gpt-oss', 'fused'"):
        experts_layout_named("deepseek")
    assert [lay.name for lay in EXPERTS_LAYOUTS] == ["gpt-oss", "fused"]


def test_mismatched_linears_are_refused():
    module = _experts_module("mixtral")
    a, b = _linears(module, "nvfp4-w4a16"), _linears(module, "fp8-channel")
    with pytest.raises(ValueError, match="different schemes"):
        QuantizedExperts.from_linears(module, a["gate_up"][:-1] + b["gate_up"][-1:], a["down"])
    with pytest.raises(ValueError, match="one gate_up and one down Linear per expert"):
        QuantizedExperts.from_linears(module, a["gate_up"], a["down"][:-1])
    with pytest.raises(ValueError, match="quantized inference Linears"):
        QuantizedExperts.from_linears(module, [nn.Linear(4, 4)] * 4, a["down"])
    with pytest.raises(ValueError, match="no known fused-experts layout"):
        QuantizedExperts.from_linears(nn.Linear(4, 4), a["gate_up"], a["down"])
    assert isinstance(a["gate_up"][0], NVFP4Linear)
