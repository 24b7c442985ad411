"""The format registry: lookups, error messages, and a new format flowing through dispatch, layout and YAML."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import blockscale as bs
from blockscale.quant import QuantizedTensor, registry
from blockscale.quant.layout import check_layout, expected_layout, padded_blocks
from blockscale.recipes import LinearRecipe
from blockscale.recipes.serialize import spec_from_dict, spec_to_dict


def test_builtin_formats_registered_in_order():
    names = [f.name for f in registry.formats()]
    assert names[:3] == ["nvfp4", "mx", "s2f6"]
    for name, cls in (("nvfp4", bs.NVFP4), ("mx", bs.MX), ("s2f6", bs.S2F6)):
        fmt = registry.format_named(name)
        assert fmt.spec_type is cls and registry.format_of(cls()) is fmt and registry.is_spec(cls())
    assert registry.format_named("nvfp4").accepts_encode_scale
    assert registry.format_named("nvfp4").fields == ("outer_scale", "amax")
    assert registry.format_named("s2f6").fields == ("signs",)
    assert registry.format_named("mx").blocks_along_any_dim
    assert registry.format_named("mx").blocked_dim(bs.MX(dim=0)) == 0
    assert {f.block_size(f.spec_type()) for f in registry.formats()[:3]} == {16, 32}


def test_unknown_spec_and_name_errors_name_the_registered_ones():
    with pytest.raises(TypeError, match=r"spec must be one of blockscale\.NVFP4, blockscale\.MX, blockscale\.S2F6"):
        registry.format_of(object())
    with pytest.raises(ValueError, match=r"format='nvfp5'.*'nvfp4', 'mx', 's2f6'"):
        registry.format_named("nvfp5")
    with pytest.raises(TypeError, match="spec must be one of"):
        bs.quantize(torch.zeros(4, 16), "nvfp4")
    with pytest.raises(ValueError, match="encode_scale is an outer encode scale"):
        bs.quantize(torch.zeros(4, 32), bs.MX(), encode_scale=1.0)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(dataclasses.replace(registry.format_named("mx"), name="mx2"))


@dataclasses.dataclass(frozen=True)
class _Toy:
    """A toy format for the test: blocks of 8 along the last dim, int8 codes = round(x), FP32 scale 1."""

    shape: tuple = (8,)
    bias: float = 0.0


def _toy_layout(spec, shape):
    lead, Kp = padded_blocks(shape, -1, 8)
    return {"codes": (lead + (Kp,), torch.int8), "scales": (lead + (Kp // 8,), torch.float32)}


def _toy_quantize(x, spec, generator=None, outputs="codes", encode_scale=None):
    K = x.shape[-1]
    xp = torch.nn.functional.pad(x.float(), (0, (-K) % 8))
    codes = torch.round(xp).clamp(-127, 127).to(torch.int8)
    q = QuantizedTensor(spec=spec, codes=codes, scales=torch.ones(*x.shape[:-1], xp.shape[-1] // 8),
                        shape=x.shape, dtype=x.dtype)
    values = codes[..., :K].float()
    return q if outputs == "codes" else values if outputs == "values" else (q, values)


def _toy_dequantize(q, dtype):
    return q.codes[..., :q.shape[-1]].to(dtype)


@pytest.fixture
def toy_format():
    fmt = registry.register(registry.Format(name="toy", spec_type=_Toy, quantize=_toy_quantize,
                                            dequantize=_toy_dequantize, layout=_toy_layout,
                                            block_size=lambda spec: 8))
    yield fmt
    registry.unregister("toy")
    assert "toy" not in [f.name for f in registry.formats()]


def test_a_registered_format_flows_through_dispatch_layout_and_yaml(toy_format):
    x = torch.tensor([[0.4, 1.6, -2.5, 3.0, 100.0, -300.0, 0.0, 7.0, 1.0, 2.0]])
    q = bs.quantize(x, _Toy())
    assert expected_layout(_Toy(), x.shape) == {"codes": ((1, 16), torch.int8), "scales": ((1, 2), torch.float32)}
    check_layout(q)
    want = torch.tensor([[0.0, 2.0, -2.0, 3.0, 100.0, -127.0, 0.0, 7.0, 1.0, 2.0]])
    assert torch.equal(q.dequantize(), want) and torch.equal(bs.fake_quantize(x, _Toy()), want)
    r = LinearRecipe(fprop_input=_Toy())
    assert r.quantized
    d = spec_to_dict(_Toy(shape=(1, 128), bias=0.5))
    assert d == {"format": "toy", "shape": [1, 128], "bias": 0.5}  # tuples as YAML lists
    assert spec_from_dict(d) == _Toy(shape=(1, 128), bias=0.5)  # and back to tuples


def test_recipe_refuses_a_spec_blocked_along_another_dim():
    with pytest.raises(ValueError, match="reduction .last. dim; use MX.dim=-1."):
        LinearRecipe(fprop_input=bs.MX(dim=0))
    with pytest.raises(ValueError, match="must be a blockscale NVFP4 / MX / S2F6"):
        LinearRecipe(fprop_input="nvfp4")
