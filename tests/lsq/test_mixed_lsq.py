"""Scale learning on mixed-precision models: the NVFP4 modules' block scales learn, the FP8 / MX
modules and the FP8 KV scales stay fixed, gradients pass through FP8 / MX activation quantizers and
the FP8 KV cache (straight through), and the mixed checkpoint exported after learning reloads exactly."""
from __future__ import annotations

import copy

import pytest
import torch

import blockscale as bs
from blockscale import lsq
from blockscale.nn import FP8Linear, MXLinear, NVFP4Linear
from blockscale.nn.kv_cache import attention_modules, kv_scales
from blockscale.nn.straight_through import straight_through
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.recipes import PTQRecipe, PTQRule, Scheme, get_ptq_recipe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128


def tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def ids(n=8, t=32, seed=0):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


MX_ATTENTION = PTQRecipe(name="mx-attention", default=Scheme("nvfp4-w4a4"),
                         rules=(PTQRule("attention", Scheme("mxfp8")),))


def quantized(recipe):
    teacher = tiny_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(recipe=recipe, n_samples=8, seq_len=32), calibration=ids(), progress=False)
    return teacher, student


def test_straight_through_forward_is_the_quantizer_backward_identity():
    x = torch.randn(4, 64, requires_grad=True)
    m = FP8Linear(64, 8, input_granularity="token")
    y = straight_through(x, m.quantize_input)
    assert torch.equal(y, m.quantize_input(x.detach()))
    g = torch.randn_like(y)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("recipe", [get_ptq_recipe("nvfp4-experts-fp8-attention"), MX_ATTENTION],
                         ids=["fp8-attention+kv", "mxfp8-attention"])
def test_lsq_learns_nvfp4_scales_only_and_exports_exactly(recipe, tmp_path):
    teacher, student = quantized(recipe)
    fixed = {n: {k: b.clone() for k, b in m.named_buffers()} for n, m in student.named_modules()
             if isinstance(m, (FP8Linear, MXLinear))}
    assert fixed
    kv_before = {n: tuple(t.clone() for t in kv_scales(a)) for n, a in attention_modules(student).items()
                 if kv_scales(a) is not None}
    assert bool(kv_before) == (recipe.kv_cache is not None)
    x = ids(2, 32, seed=3)
    with torch.no_grad():
        ptq_logits = student(x).logits
    names = lsq.enable(student, mode="tied", init="stored")
    assert names and all(".mlp." in n for n in names)  # only the NVFP4 modules learn
    with torch.no_grad():
        assert torch.equal(student(x).logits, ptq_logits)  # step 0 is the PTQ model, bit for bit
    # every NVFP4 amax gets a gradient, including layer 0's, through the quantized attention of layer 1
    loss = student(x).logits.float().square().mean()
    loss.backward()
    for p in lsq.scale_parameters(student):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)
    student.zero_grad()
    cfg = lsq.DistillConfig(steps=3, lr_scales=3e-2, batch_size=2, seq_len=16, seed=0)
    lsq.distill(student, teacher, ids(8, 32, seed=5), cfg, progress=False)
    lsq.freeze(student)
    for n, bufs in fixed.items():
        m = student.get_submodule(n)
        for k, b in bufs.items():
            assert torch.equal(getattr(m, k).view(torch.uint8) if b.dtype.itemsize == 1 else getattr(m, k),
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b), (n, k)
    for n, (k, v) in kv_before.items():
        got = kv_scales(student.get_submodule(n))
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    with torch.no_grad():
        learned_logits = student(x).logits
    assert not torch.equal(learned_logits, ptq_logits)  # the scales did move
    for fmt in ("compressed-tensors", "modelopt"):
        if fmt == "modelopt" and any(isinstance(m, MXLinear) and m.element == "e2m1" for m in student.modules()):
            continue
        out = bs.export_checkpoint(student, tmp_path / fmt, fmt)
        with torch.no_grad():
            assert torch.equal(bs.load(out)(x).logits, learned_logits), fmt
