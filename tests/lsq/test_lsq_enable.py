"""Learnable scales on a PTQ model: step-0 equality, scale-only distillation, exact export."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
from blockscale import lsq
from blockscale.nn import NVFP4Linear
from blockscale.ptq import AWQOptions, PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread")
tiny_llama, ids = tiny_hf_llama, token_ids


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("mode", ["tied", "dual"])
@pytest.mark.parametrize("fields", [dict(method="gptq", scale_rule="4over6", activations="w4a4"),
                                    dict(method="awq", scale_rule="sweep", options=AWQOptions(grid=4))])
def test_step0_equals_the_ptq_model(mode, fields):
    model = tiny_llama()
    quantize_model(model, PTQConfig(n_samples=8, seq_len=32, batch_size=4, **fields), ids(), progress=False)
    before = logits(model, ids(2, 24, seed=3))
    names = lsq.enable(model, mode=mode)
    assert len(names) == 14 and not any(isinstance(m, NVFP4Linear) and "learner" not in n
                                        for n, m in model.named_modules() if n in names)
    assert torch.equal(logits(model, ids(2, 24, seed=3)), before)


def test_step0_with_full_precision_weights_and_a_rule():
    fp = tiny_llama()
    model = copy.deepcopy(fp)
    quantize_model(model, PTQConfig(scale_rule="4over6"), progress=False)
    before = logits(model, ids(2, 24, seed=4))
    lsq.enable(model, mode="tied", init="4over6", weights=fp)
    assert torch.equal(logits(model, ids(2, 24, seed=4)), before)
    assert torch.equal(lsq.weight_parameters(model)[0], fp.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_scale_only_distillation_then_exact_export(mode, tmp_path):
    teacher = tiny_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(method="rtn"), progress=False)
    lsq.enable(student, mode=mode, weights=teacher)
    for p in student.parameters():
        p.requires_grad_(False)
    scales = lsq.scale_parameters(student)
    for p in scales:
        p.requires_grad_(True)
    n_scales = sum(p.numel() for p in scales)
    n_weights = sum(p.numel() for p in lsq.weight_parameters(student))
    assert n_scales == n_weights // 16 * (1 if mode == "tied" else 2)
    frozen = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
    opt = torch.optim.Adam(scales, lr=1e-3)
    x = ids(8, 32, seed=1)
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(x).logits, -1)

    def kl():
        s_logp = F.log_softmax(student(x).logits, -1)
        return F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")

    with torch.no_grad():
        first = float(kl())
    for _ in range(30):
        opt.zero_grad()
        loss = kl()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = float(kl())
    assert last < 0.9 * first, (first, last)
    for n, p in student.named_parameters():  # nothing but the amaxes moved
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    trained = logits(student, ids(2, 24, seed=5))
    lsq.freeze(student)
    assert not lsq.lsq_layers(student)
    assert torch.equal(logits(student, ids(2, 24, seed=5)), trained)
    for fmt in ("compressed-tensors", "modelopt"):
        back = bs.load(bs.export_checkpoint(student, tmp_path / fmt, fmt))
        assert torch.equal(logits(back, ids(2, 24, seed=5)), trained), fmt


def test_enable_errors():
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        lsq.enable(tiny_llama())
    model = tiny_llama()
    quantize_model(model, PTQConfig(), progress=False)
    with pytest.raises(ValueError, match="mode"):
        lsq.enable(model, mode="triple")
    with pytest.raises(ValueError, match="init"):
        lsq.enable(model, init="7")
    with pytest.raises(ValueError, match="latent weight has shape"):
        lsq.enable(model, weights={n: torch.zeros(3, 16) for n, m in model.named_modules()
                                   if isinstance(m, NVFP4Linear)})
