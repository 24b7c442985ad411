"""The one scheme table (quant.schemes, issue 30): names of stored modules, recipe schemes read from their rows,
and a checkpoint codec that refuses an MX element it has no format for instead of mislabelling it."""
from __future__ import annotations

import pytest

from blockscale.quant import FP8, MX, NVFP4
from blockscale.quant.nvfp4.weighted import WEIGHTED_RULES
from blockscale.quant.schemes import RECIPE_SCHEME_NAMES, SCHEME_TABLE, scheme_row, stored_scheme_name
from blockscale.recipes import SCHEME_NAMES, Scheme

STORED = {  # (kind, weights, inputs) -> the name every loader and exporter has used for it
    ("nvfp4", "nvfp4", "nvfp4"): "nvfp4-w4a4", ("nvfp4", "nvfp4", None): "nvfp4-w4a16",
    ("fp8", "tensor", "tensor"): "fp8-w8a8", ("fp8", "channel", "token"): "fp8-w8a8",
    ("fp8", "tensor", None): "fp8-w8a16", ("fp8", "channel", None): "fp8-w8a16",
    ("fp8", "block", "block"): "fp8-block", ("fp8", "block", "token"): "fp8-block",
    ("mx", "e4m3", "e4m3"): "mxfp8", ("mx", "e2m1", "e2m1"): "mxfp4", ("mx", "e2m1", None): "mxfp4-w4a16",
    ("mx", "e4m3", None): "mxfp8-w8a16",
}


def test_stored_modules_are_named_by_the_table():
    assert {t: stored_scheme_name(*t) for t in STORED} == STORED
    with pytest.raises(ValueError, match="no quantization scheme stores a mx Linear with weights 'e5m2'"):
        stored_scheme_name("mx", "e5m2", None)


def test_recipe_schemes_are_the_table_rows():
    assert SCHEME_NAMES == RECIPE_SCHEME_NAMES == ("nvfp4-w4a4", "nvfp4-w4a16", "fp8-w8a8", "fp8-block", "mxfp8",
                                                    "mxfp4", "mxfp4-w4a16", "bf16")
    assert [r.name for r in SCHEME_TABLE if not r.in_recipes] == ["fp8-w8a16", "mxfp8-w8a16"]
    want = {  # name -> (family, weight spec, quantizes inputs, static inputs, block size)
        "nvfp4-w4a4": ("nvfp4", NVFP4(), True, True, 16), "nvfp4-w4a16": ("nvfp4", NVFP4(), False, False, 16),
        "fp8-w8a8": ("fp8", FP8("e4m3", granularity="tensor"), True, True, None),
        "fp8-block": ("fp8", FP8("e4m3", "block", (128, 128)), True, False, None),
        "mxfp8": ("mx", MX("e4m3"), True, False, 32), "mxfp4": ("mx", MX("e2m1"), True, False, 32),
        "mxfp4-w4a16": ("mx", MX("e2m1"), False, False, 32), "bf16": ("none", None, False, False, None),
    }
    for name, (family, spec, quantizes, static, block) in want.items():
        s = Scheme(name)
        assert (s.family, s.weight_spec, s.quantizes_activations, s.static_activations, s.block_size) == \
            (family, spec, quantizes, static, block), name
        assert s.options == scheme_row(name).defaults()
    dyn = Scheme("fp8-w8a8", weights="channel", activations="dynamic")
    assert (dyn.weight_spec, dyn.static_activations, dyn.label) == (FP8("e4m3", granularity="channel"), False,
                                                                    "fp8-w8a8 channel/dynamic")
    hess = Scheme("nvfp4-w4a4", scale_rule="hessian-4over6", act_scale_rule="4over6")
    assert hess.hessian_scales and hess.weight_spec == WEIGHTED_RULES["hessian-4over6"]
    assert hess.label == "nvfp4-w4a4 hessian-4over6 a:4over6" and Scheme("mxfp4", scale_rule="floor").label == \
        "mxfp4 floor"


def test_compressed_tensors_refuses_an_mx_element_it_has_no_format_for():
    """Before, every MX element but e4m3 was written as "mxfp4-pack-quantized" with 4 bits."""
    from blockscale.export.ct_schemes import group_format, scheme_args
    from blockscale.export.module_schemes import ModuleScheme

    assert group_format(ModuleScheme("mx", "e2m1", None)) == "mxfp4-pack-quantized"
    assert scheme_args(ModuleScheme("mx", "e4m3", "e4m3"))[0]["num_bits"] == 8
    for call in (group_format, lambda s: scheme_args(s)):
        with pytest.raises(ValueError, match="compressed-tensors has no format for MX element 'e5m2'"):
            call(ModuleScheme("mx", "e5m2", None))


def _option_sets(name: str):
    import itertools

    opts = scheme_row(name).options
    for values in itertools.product(*opts.values()):
        yield dict(zip(opts, values))


@pytest.mark.parametrize("name", [n for n in RECIPE_SCHEME_NAMES if n != "bf16"])
def test_a_row_says_what_its_linears_are_stored_as_and_what_they_feed_the_gemm(name):
    """``stored`` is the scheme of the inference Linear PTQ builds, and ``input_quantizer`` is what that Linear
    does to its inputs: its output is the GEMM of the quantized inputs with the dequantized weight."""
    import torch
    import torch.nn.functional as F

    from blockscale.export.module_schemes import ModuleScheme, scheme_of
    from blockscale.ptq.scheme_modules import build_linear
    from blockscale.ptq.scheme_quantize import group_weight_scale, rtn_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g)
    x = torch.randn(4, 256, generator=g) * 3
    for options in _option_sets(name):
        s = Scheme(name, **{k: v for k, v in options.items() if k in ("scale_rule", "error", "act_scale_rule",
                                                                       "weights", "activations")})
        if s.hessian_scales:
            continue  # stored as its base rule (WEIGHTED_RULES); built and fed like it
        q = rtn_quantize(w, s.weight_spec, group_weight_scale(s, [w]))
        amax = float(x.abs().max())
        lin = build_linear(q, None, s, amax, torch.float32)
        assert scheme_of(lin) == ModuleScheme(*s.stored), (name, options)
        assert stored_scheme_name(*s.stored) == name
        iq = s.input_quantizer(amax)
        assert (iq is None) == (not s.quantizes_activations)
        fed = x if iq is None else iq(x)
        torch.testing.assert_close(lin(x), F.linear(fed, lin.dequantized_weight(torch.float32)), rtol=1e-5,
                                   atol=1e-5)
        if iq is not None:
            assert not torch.allclose(fed, x), (name, options)


def test_stored_labels_say_what_the_name_does_not():
    from blockscale.quant.schemes import stored_scheme_label

    assert stored_scheme_label("fp8", "channel", "token") == "fp8-w8a8 channel/token"
    assert stored_scheme_label("fp8", "block", "block") == "fp8-block block/block"
    assert stored_scheme_label("fp8", "tensor", None) == "fp8-w8a16 tensor/none"
    assert stored_scheme_label("nvfp4", "nvfp4", "nvfp4") == "nvfp4-w4a4"
    assert stored_scheme_label("mx", "e2m1", None) == "mxfp4-w4a16"
    with pytest.raises(ValueError, match="no quantization scheme stores"):
        stored_scheme_label("mx", "e5m2", None)
