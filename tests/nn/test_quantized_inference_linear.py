"""The one quantized inference Linear (nn.quantized_linear, issue 30 phase 2): a weight's buffers come from its
format's layout under the checkpoint names, the three load-compatible classes are adapters of it, and the
inference module of a scheme is found by the scheme's stored kind."""
from __future__ import annotations

import pytest
import torch

from blockscale.nn.fp8_linear import FP8Linear
from blockscale.nn.mx_linear import MXLinear
from blockscale.nn.nvfp4_linear import NVFP4Linear
from blockscale.nn.quantized_linear import QuantizedInferenceLinear, weight_buffers
from blockscale.quant import FP8, MX, NVFP4, quantize
from blockscale.recipes import Scheme

E4M3, F32, U8 = torch.float8_e4m3fn, torch.float32, torch.uint8


def test_weight_buffers_are_the_checkpoint_tensors_of_each_format():
    N, K = 256, 384
    assert weight_buffers(NVFP4(), N, K) == {"weight_packed": ("codes", (N, K // 2), U8),
                                             "weight_scale": ("scales", (N, K // 16), E4M3),
                                             "weight_global_scale": ("outer_scale", (1,), F32)}
    assert weight_buffers(FP8("e4m3"), N, K) == {"weight": ("codes", (N, K), E4M3), "weight_scale": ("scales", (1,), F32)}
    assert weight_buffers(FP8("e4m3", "channel"), N, K)["weight_scale"] == ("scales", (N, 1), F32)
    assert weight_buffers(FP8("e4m3", "block", (128, 128)), N, K)["weight_scale"] == ("scales", (2, 3), F32)
    assert weight_buffers(MX("e4m3"), N, K) == {"weight": ("codes", (N, K), E4M3), "weight_scale": ("scales", (N, K // 32), U8)}
    assert weight_buffers(MX("e2m1"), N, K) == {"weight_packed": ("codes", (N, K // 2), U8),
                                                "weight_scale": ("scales", (N, K // 32), U8)}


@pytest.mark.parametrize("make, keys", [
    (lambda: NVFP4Linear(64, 32, True, input_scale_rule="6"),
     ["bias", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"]),
    (lambda: FP8Linear(64, 32, True, weight_granularity="channel", input_granularity="tensor"),
     ["bias", "weight", "weight_scale", "input_scale"]),
    (lambda: MXLinear(64, 32, False, element="e2m1", input_element="e2m1"), ["weight_packed", "weight_scale"]),
])
def test_state_dicts_keep_their_names_order_and_empty_values(make, keys):
    m = make()
    sd = m.state_dict()
    assert list(sd) == keys
    assert isinstance(m, QuantizedInferenceLinear)
    if isinstance(m, MXLinear):
        assert sd["weight_scale"].unique().tolist() == [127]  # 2**0
    if isinstance(m, NVFP4Linear):
        assert sd["weight_global_scale"].tolist() == [1.0] and sd["input_global_scale"].tolist() == [1.0]


def test_scheme_modules_are_found_by_stored_kind():
    assert [QuantizedInferenceLinear.class_for(k) for k in ("nvfp4", "fp8", "mx")] == [NVFP4Linear, FP8Linear, MXLinear]
    with pytest.raises(ValueError, match="no quantized Linear stores kind 'int4'; known: 'fp8', 'mx', 'nvfp4'"):
        QuantizedInferenceLinear.class_for("int4")
    from blockscale.ptq.scheme_modules import build_linear

    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="keeps the Linear in high precision"):
        build_linear(quantize(w, NVFP4()), None, Scheme("bf16"), 1.0, torch.float32)


def test_a_weight_of_another_shape_is_refused_when_loaded():
    m = FP8Linear(64, 32)
    with pytest.raises(ValueError, match=r"q.codes has shape \(16, 64\); FP8Linear.weight of a \(32, 64\) weight"):
        m.load_quantized(quantize(torch.randn(16, 64), FP8("e4m3")))


def test_w4a4_inputs_pass_gradients_straight_through():
    """Every quantized Linear trains through its input quantizer (straight-through); NVFP4Linear W4A4 did not:
    its fake-quantized input had no gradient, so layers before it got none."""
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    from blockscale.quant.nvfp4 import input_encode_scale

    x = (torch.randn(4, 64) * 2).requires_grad_()
    m = NVFP4Linear.from_quantized(quantize(w, NVFP4(), encode_scale=torch.tensor(0.5)),
                                   input_global_scale=input_encode_scale(float(x.abs().max())), input_scale_rule="6")
    m(x).sum().backward()
    torch.testing.assert_close(x.grad, m.dequantized_weight().sum(0).expand(4, 64))
