"""FP8 in training recipes: ``{format: fp8, ...}`` YAML round-trips (including the tuple block_shape),
and a QuantizedLinear training step with an FP8 recipe built from YAML follows the recipe exactly
and gives finite gradients."""
import pytest
import torch
import yaml

import blockscale as bs
from blockscale.nn import QuantizedLinear
from blockscale.quant.fp8 import FP8
from blockscale.recipes import load_recipe_file
from blockscale.recipes.serialize import recipe_to_dict, save_recipe, spec_from_dict, spec_to_dict

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

YAML = """
name: fp8-w8a8
description: FP8 per-token activations, per-channel weights, E5M2 gradients
linear:
  fprop_input: {format: fp8, element: e4m3, granularity: token}
  fprop_weight: {format: fp8, element: e4m3, granularity: channel}
  dgrad_grad: {format: fp8, element: e5m2, granularity: tensor, rounding: stochastic}
  dgrad_weight: {format: fp8, element: e4m3, granularity: block, block_shape: [128, 128]}
  wgrad_grad: {format: fp8, element: e5m2, granularity: tensor}
  wgrad_input: {format: fp8, element: e4m3, granularity: block, block_shape: [1, 128]}
"""


def test_spec_dict_round_trip_and_errors():
    for spec in (FP8(), FP8("e5m2", "channel", rounding="stochastic", sr_mode="exact"),
                 FP8(granularity="block"), FP8(granularity="block", block_shape=(1, 128))):
        d = spec_to_dict(spec)
        assert d["format"] == "fp8" and isinstance(d["block_shape"], list)
        assert spec_from_dict(yaml.safe_load(yaml.safe_dump(d))) == spec
    with pytest.raises(ValueError, match=r"fprop_weight: block_shape=\(64, 128\) is not supported"):
        spec_from_dict({"format": "fp8", "granularity": "block", "block_shape": [64, 128]}, "fprop_weight")
    with pytest.raises(ValueError, match=r"unknown fp8 option\(s\) \['outer'\]"):
        spec_from_dict({"format": "fp8", "outer": "tensor"})
    with pytest.raises(ValueError, match="'fp8'"):  # the registered names include fp8
        spec_from_dict({"format": "fp9"})


def test_yaml_recipe_round_trip(tmp_path):
    p = tmp_path / "fp8.yaml"
    p.write_text(YAML)
    r = load_recipe_file(p)
    lin = r.linear
    assert lin.fprop_input == FP8("e4m3", "token") and lin.fprop_weight == FP8("e4m3", "channel")
    assert lin.wgrad_input == FP8(granularity="block", block_shape=(1, 128))
    save_recipe(r, tmp_path / "again.yaml")
    assert load_recipe_file(tmp_path / "again.yaml") == r
    assert recipe_to_dict(r)["linear"]["dgrad_weight"]["block_shape"] == [128, 128]


def test_training_step_with_fp8_recipe_from_yaml(tmp_path):
    p = tmp_path / "fp8.yaml"
    p.write_text(YAML)
    r = load_recipe_file(p).linear
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(256, 192)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(192, 256, generator=g) * 0.05)
    x = torch.randn(3, 40, 256, generator=g, requires_grad=True)
    dy = torch.randn(3, 40, 192, generator=g)
    layer = QuantizedLinear.from_linear(lin, r)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-2)
    y = layer(x)
    (y * dy).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert torch.isfinite(layer.bias.grad).all()
    # the forward is exactly the recipe: fake-quantized x (per token) times fake-quantized W (per row)
    xq = bs.fake_quantize(x.detach().reshape(-1, 256), r.fprop_input, dtype=torch.float32)
    wq = bs.fake_quantize(lin.weight.detach(), r.fprop_weight, dtype=torch.float32)
    want = (xq @ wq.t() + lin.bias.detach()).reshape(3, 40, 192)
    assert torch.equal(y.detach(), want)
    # the gradients are close to the unquantized ones (8-bit elements)
    xr = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(xr, lin.weight)
    (ref * dy).sum().backward()
    rel = (x.grad - xr.grad).norm() / xr.grad.norm()
    assert rel < 0.2, rel
    w0 = layer.weight.detach().clone()
    opt.step()
    assert torch.isfinite(layer.weight).all() and not torch.equal(layer.weight, w0)
