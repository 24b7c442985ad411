"""learn-scales takes the PTQ method's options for a model-name input (the same --awq-* / --gptq-* flags as
quantize), e.g. the best W4A16 start of docs/results/recovery-models.md, and refuses them for a checkpoint input
(which was quantized already) instead of ignoring them."""
from __future__ import annotations

import pytest

from blockscale.cli.learn_scales import _init_recipe, _ptq_config
from blockscale.cli.main import build_parser
from blockscale.errors import UsageError
from blockscale.ptq import AWQOptions, GPTQOptions, RTNOptions


def _args(*extra):
    return build_parser().parse_args(["learn-scales", "smollm2-135m", "--out", "o", *extra])


def test_method_options_reach_the_ptq_start():
    c = _ptq_config(_args("--method", "awq", "--awq-quantizer", "gptq", "--scale-rule", "hessian"), None)
    assert (c.method, c.scale_rule) == ("awq", "hessian")
    assert c.options == AWQOptions(quantizer="gptq", clip=False)  # auto-clip resolved off with GPTQ
    c = _ptq_config(_args("--method", "gptq", "--gptq-damp", "0.05", "--scale-rule", "hessian"), None)
    assert c.options == GPTQOptions(damp=0.05)
    assert _ptq_config(_args(), None).options == RTNOptions()


def test_method_flags_with_a_checkpoint_input_are_refused():
    with pytest.raises(UsageError, match="--awq-quantizer.*quantized checkpoint already"):
        _init_recipe(_args("--awq-quantizer", "gptq"), is_ckpt=True)
    assert _init_recipe(_args(), is_ckpt=True) is None
