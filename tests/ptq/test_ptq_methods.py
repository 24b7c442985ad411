"""PTQ methods behind one protocol (blockscale.ptq.protocol / .methods): the registry, each method's own
validated options in PTQConfig, a new method as one class plus a registration, and the command-line
flags made from the options dataclasses."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import blockscale as bs
from blockscale import cli
from blockscale.cli.quantize import add_method_flags, method_options
from blockscale.errors import UsageError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import (AWQOptions, GPTQOptions, METHODS, PTQConfig, PTQMethod, QuantizedWeight, RTNOptions,
                            SmoothQuantOptions, StatisticsRequest, option, quantize_model, register_method)
from blockscale.ptq.options import check_options
from blockscale.quant import NVFP4, quantize

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_and_options_in_the_config():
    assert list(METHODS) == ["rtn", "awq", "smoothquant", "gptq", "autoround"]
    # None: the method's defaults (AWQ's auto-clip resolved: on for the default NVFP4 recipe)
    for name, opts in (("rtn", RTNOptions()), ("awq", AWQOptions(clip=True)), ("smoothquant", SmoothQuantOptions()),
                       ("gptq", GPTQOptions())):
        assert PTQConfig(method=name).options == opts
    cfg = PTQConfig(method="gptq", scale_rule="4over6", options=GPTQOptions(block_size=32, four_over_six="plain"))
    d = cfg.to_dict()
    assert d["method"] == "gptq" and d["options"] == dict(damp=0.01, block_size=32, act_order=False,
                                                          static_groups=False, four_over_six="plain",
                                                          true_sequential=False, rounded_inputs=False)
    assert cfg.label == "gptq 4over6-mse w4a16"
    assert PTQConfig(method="rtn", scale_rule="sweep", activations="w4a4").options == RTNOptions()
    with pytest.raises(UsageError, match=r"options is a AWQOptions, but method='gptq' takes GPTQOptions"):
        PTQConfig(method="gptq", options=AWQOptions())
    with pytest.raises(UsageError, match=r"method='hqq' is not supported; allowed values: 'rtn', 'awq'"):
        PTQConfig(method="hqq")
    assert not PTQConfig().needs_calibration and PTQConfig(activations="w4a4").needs_calibration
    assert all(PTQConfig(method=m).needs_calibration for m in ("awq", "smoothquant", "gptq"))


@pytest.mark.parametrize("make,field", [
    (lambda: AWQOptions(grid=0), r"AWQOptions.grid=0: must be a finite int in \[1, 1000\]"),
    (lambda: AWQOptions(grid=1001), "AWQOptions.grid=1001"),
    (lambda: AWQOptions(duo_scaling=1), "AWQOptions.duo_scaling=1: expected True or False"),
    (lambda: AWQOptions(max_tokens=2.0), "AWQOptions.max_tokens=2.0: expected an int"),
    (lambda: AWQOptions(max_tokens=0), "AWQOptions.max_tokens=0: must be a finite int >= 1"),
    (lambda: SmoothQuantOptions(alpha=1.5), r"SmoothQuantOptions.alpha=1.5: must be a finite number in \[0, 1\]"),
    (lambda: SmoothQuantOptions(alpha=float("nan")), "SmoothQuantOptions.alpha=nan"),
    (lambda: GPTQOptions(damp=1.0), r"GPTQOptions.damp=1.0: must be a finite number in \[0, 1\)"),
    (lambda: GPTQOptions(block_size=100), "GPTQOptions.block_size=100: expected a positive multiple of 16"),
    (lambda: GPTQOptions(four_over_six="both"), "GPTQOptions.four_over_six='both': allowed values: 'aware', 'plain'"),
])
def test_options_are_validated_naming_the_field(make, field):
    with pytest.raises(UsageError, match=field):
        make()


@dataclasses.dataclass(frozen=True)
class HalfOptions:
    rule: str = option("4", "the block scale rule used instead of the config's", choices=("4", "6"))
    shrink: float = option(0.5, "weights are multiplied by this before rounding", lo=0.0, hi=1.0, lo_open=True)

    def __post_init__(self):
        check_options(self)


class Half(PTQMethod):
    """A test method: records the per-channel absmax, scales every weight by ``shrink`` in the transform
    step (changing the model: only a test), rounds with its own scale rule."""

    name = "half"
    Options = HalfOptions
    flag_prefix = "half"
    calls: list = []

    def statistics(self):
        self.calls.append("statistics")
        return StatisticsRequest(channel_absmax=True)

    def transform_layer(self, layer):
        self.calls.append(("transform", layer.index))
        assert all(st.absmax is not None and st.tokens > 0 for st in layer.stats.values())
        with torch.no_grad():
            for lin in layer.linears.values():
                lin.weight.mul_(self.options.shrink)
        return {n: self.options.shrink for n in layer.linears}

    def quantize_weight(self, weight, stats, spec, encode_scale):
        self.calls.append("quantize")
        return QuantizedWeight(quantize(weight, dataclasses.replace(spec, scale_rule=self.options.rule),
                                        encode_scale=encode_scale), note="half")


@pytest.fixture
def half(monkeypatch):
    monkeypatch.setattr(Half, "calls", [])
    monkeypatch.delitem(METHODS, "half", raising=False)
    register_method(Half)
    yield Half
    METHODS.pop("half", None)


def test_a_new_method_is_one_class_and_a_registration(half):
    model = tiny_hf_llama()
    ref = [m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("q_proj")]
    with pytest.warns(RuntimeWarning, match="q_proj: half"):  # the method's note reaches the report
        rep = quantize_model(model, PTQConfig(method="half", options=HalfOptions(shrink=0.25), batch_size=4),
                             token_ids(8, 16), progress=False)
    n_layers, n_linears = rep.layers, len(rep.linears)
    assert half.calls[0] == "statistics"
    assert [c for c in half.calls if c != "quantize" and c != "statistics"] == [("transform", i)
                                                                               for i in range(n_layers)]
    assert half.calls.count("quantize") == n_linears
    assert all(lr.smoothing_alpha == 0.25 and lr.note == "half" for lr in rep.linears)
    q_projs = [m for n, m in model.named_modules() if n.endswith("q_proj")]
    for lin, w in zip(q_projs, ref):
        assert isinstance(lin, NVFP4Linear)
        assert torch.equal(lin.weight_scale.view(torch.uint8),
                           quantize(w * 0.25, NVFP4("4"), encode_scale=lin.weight_global_scale).scales.view(torch.uint8))
    with pytest.raises(ValueError, match="registered already"):
        register_method(type("Half", (Half,), {}))
    with pytest.raises(TypeError, match="PTQMethod subclass"):
        register_method(HalfOptions)


def test_cli_flags_come_from_the_options_dataclasses(half):
    import argparse

    p = argparse.ArgumentParser()
    add_method_flags(p)
    args = p.parse_args(["--half-rule", "6", "--half-shrink", "0.5", "--gptq-block-size", "32", "--gptq-act-order"])
    assert method_options(args, "half") == HalfOptions(rule="6", shrink=0.5)
    assert method_options(args, "gptq") == GPTQOptions(block_size=32, act_order=True)
    assert method_options(args, "awq") == AWQOptions() and method_options(args, "rtn") == RTNOptions()
    args = p.parse_args(["--gptq-block-size", "100"])
    with pytest.raises(UsageError, match=r"^--gptq-block-size 100: expected a positive multiple of 16"):
        method_options(args, "gptq")
    args = p.parse_args(["--no-awq-duo-scaling", "--awq-grid", "5", "--sq-alpha", "0.25"])
    assert method_options(args, "awq") == AWQOptions(grid=5, duo_scaling=False)
    assert method_options(args, "smoothquant") == SmoothQuantOptions(alpha=0.25)


def test_quantize_help_lists_every_method_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--awq-grid", "20"), ("--awq-max-tokens", "4096"), ("--sq-alpha", "0.5"),
                          ("--gptq-damp", "0.01"), ("--gptq-block-size", "128"), ("--autoround-iters", "200"),
                          ("--autoround-min-clip", "0.5")):
        assert flag in text and f"(default: {default})" in text.split(flag, 2)[-1][:200], flag
    for flag in ("--awq-duo-scaling, --no-awq-duo-scaling", "--gptq-act-order", "--gptq-static-groups",
                 "--gptq-4over6 {aware,plain}", "--method {rtn,awq,smoothquant,gptq,autoround}",
                 "--autoround-clip-scales, --no-autoround-clip-scales"):
        assert flag in text, flag


def test_method_options_reach_the_config_from_the_command_line(monkeypatch, tmp_path):
    seen = {}

    def fake(model, tokenizer, config, *a, **k):
        seen["config"] = config
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr("blockscale.ptq.pipeline.calibrate_and_quantize", fake)
    code = cli.main(["quantize", "stories260k", "--out", str(tmp_path / "q"), "--method", "gptq",
                     "--gptq-4over6", "plain", "--gptq-damp", "0.05", "--scale-rule", "4over6"])
    assert code == 130
    assert seen["config"].options == GPTQOptions(damp=0.05, four_over_six="plain")
    assert bs.PTQConfig is PTQConfig
