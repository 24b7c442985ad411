"""Latent weights in block units (``lsq.latent_weight``) and best-step selection on held-out windows
(``DistillConfig.keep_best``, ``train.best_step``, ``RecoveryConfig.holdout``)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from blockscale import lsq
from blockscale.lsq.distill import DistillConfig, distill, eval_distill_loss
from blockscale.lsq.latent_weight import block_units
from blockscale.lsq.recover import split_holdout
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.train import LoopConfig

transformers = pytest.importorskip("transformers")
from tiny_models import llama_and_its_4over6_ptq, logits, tiny_hf_llama, token_ids  # noqa: E402
from tiny_moe import tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    return llama_and_its_4over6_ptq()


# ----------------------------------------------------------------------------- block units

def test_block_units_are_the_power_of_two_at_or_below_the_scale_clamped():
    s = torch.tensor([0.3, 0.25, 1.0, 3.0, 2.0 ** -110, 0.0, 7e-3])
    want = torch.tensor([0.25, 0.25, 1.0, 1.0, 2.0 ** -100, 2.0 ** -100, 2.0 ** -8])
    assert torch.equal(block_units(s), want)


@pytest.mark.parametrize("mode,param", [("tied", "amax"), ("dual", "log")])
@pytest.mark.parametrize("init", ["6", "4over6"])
def test_block_units_keep_the_forward_and_the_export_bit_for_bit(mode, param, init):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48).unsqueeze(1)  # block scales over 4 decades
    w[3, :16] = 0.0  # an all-zero block
    raw = lsq.NVFP4ScaleLearner(w, 1.0, mode=mode, init=init, param=param, train_weight=True)
    rel = copy.deepcopy(raw)
    rel.use_block_units(rel.block_scale())
    assert rel.weight_units == "block" and "weight" not in dict(rel.named_parameters())
    assert [n for n, _ in rel.named_parameters() if "weight" in n] == ["weight_relative"]
    assert rel.weight_parameter().requires_grad
    assert torch.equal(rel.latent_weight(), raw.weight)
    assert torch.equal(rel(), raw())
    qa, qb = raw.to_quantized(), rel.to_quantized()
    assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.scales.view(torch.uint8), qb.scales.view(torch.uint8))
    # the unit is the power of two at or below each block's real scale
    s = raw.block_scale()
    u = rel.unit
    assert bool(((u <= s) | (s == 0) | (u == 1)).all()) and bool(((2 * u > s) | (u == 1)).all())
    with pytest.raises(ValueError, match="block units already"):
        rel.use_block_units(s)


@pytest.mark.parametrize("units", ["raw", "block"])
def test_one_adam_step_moves_each_weight_by_lr_times_its_unit(units):
    """Adam's first step is lr * g / (|g| + eps): lr per element of the trained tensor, so lr times the block's
    unit in block units (the stated step size), lr itself in raw units."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g) * torch.logspace(-2, 0, 32).unsqueeze(1)
    learner = lsq.NVFP4ScaleLearner(w, 1.0, mode="tied", train_weight=True)
    learner.amax.requires_grad_(False)
    if units == "block":
        learner.use_block_units(learner.block_scale())
    p = learner.weight_parameter()
    lr = 1e-3
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0, eps=1e-30)
    w0 = learner.latent_weight().detach().clone()
    target = torch.randn(32, 64, generator=g)
    (learner() * target).sum().backward()
    grad_sign = torch.sign(p.grad)
    opt.step()
    moved = learner.latent_weight().detach() - w0
    unit = (learner.unit.repeat_interleave(16, -1) if units == "block" else torch.ones_like(w0))
    want = -lr * unit * grad_sign
    inside = grad_sign != 0
    assert inside.float().mean() > 0.5
    # to within the FP32 rounding of w0 + step (a few ulps of w0) and Adam's eps
    err = (moved - want).abs()[inside]
    bound = (4 * torch.finfo(torch.float32).eps * w0.abs() + 1e-5 * want.abs())[inside]
    assert bool((err <= bound).all()), float((err - bound).max())
    # a block-units step is the unit's share of the raw one: it differs between blocks by up to 100x here
    if units == "block":
        assert float(unit.max() / unit.min()) >= 64


def test_enable_in_block_units_is_the_ptq_model_at_step_0_and_freezes_back(pair):
    teacher, ptq = pair
    x = token_ids(2, 24)
    want = logits(ptq, x)
    student = copy.deepcopy(ptq)
    lsq.enable(student, mode="dual", init="stored", weights=teacher, param="log", weight_units="block",
               train_weights=True)
    ws = lsq.weight_parameters(student)
    assert ws and all(w.requires_grad for w in ws)
    names = [n for n, p in student.named_parameters() if p.requires_grad and ".learner." in n and "weight" in n]
    assert names and all(n.endswith("weight_relative") for n in names)
    assert torch.equal(logits(student, x), want)
    lsq.freeze(student)
    assert torch.equal(logits(student, x), want)
    packed = {n: b for n, b in student.named_buffers() if n.endswith("weight_packed")}
    for n, b in ptq.named_buffers():
        if n.endswith("weight_packed"):
            assert torch.equal(packed[n], b), n
    with pytest.raises(ValueError, match="weight_units='cells'; allowed values: raw, block"):
        lsq.enable(copy.deepcopy(ptq), weight_units="cells")


def test_moe_experts_in_block_units_keep_step_0():
    fp = tiny_moe("mixtral")
    q = copy.deepcopy(fp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        quantize_model(q, PTQConfig(), progress=False)
    x = token_ids(2, 16)
    want = logits(q, x)
    lsq.enable(q, mode="tied", weight_units="block")  # latent weights: the dequantized ones
    learners = [l for m in q.modules() if isinstance(m, lsq.LSQExperts) for l in m.learners().values()]
    assert learners and all(l.weight_units == "block" for l in learners)
    assert torch.equal(logits(q, x), want)


# ----------------------------------------------------------------------------- best-step selection

CFG = dict(batch_size=4, seq_len=32, log_every=5, max_grad_norm=0.0)


def _student(pair, mode="dual", param="log"):
    teacher, ptq = pair
    student = copy.deepcopy(ptq)
    lsq.enable(student, mode=mode, init="stored", weights=teacher, param=param)
    return teacher, student


def test_keep_best_never_returns_a_student_worse_than_its_start(pair):
    """A learning rate far too large makes every step worse on the held-out windows: the start (step 0) is
    kept, and the student is the PTQ model bit for bit."""
    teacher, student = _student(pair)
    held = token_ids(8, 32, seed=7)
    x = token_ids(2, 24)
    want = logits(pair[1], x)
    res = distill(student, teacher, token_ids(16, 40, seed=1),
                  DistillConfig(steps=6, lr_scales=3.0, eval_every=2, keep_best=True, **CFG),
                  eval_tokens=held, progress=False)
    losses = dict(res["eval_losses"])
    assert sorted(losses) == [0, 2, 4, 6]
    assert min(losses[s] for s in (2, 4, 6)) > losses[0]  # (what the test is about: learning made it worse)
    assert res["best_step"] == 0 and res["best_eval_loss"] == losses[0]
    assert torch.equal(logits(student, x), want)


@pytest.fixture(scope="module")
def rtn6():
    teacher = tiny_hf_llama()
    ptq = copy.deepcopy(teacher)
    quantize_model(ptq, PTQConfig(), progress=False)  # RTN-6: room to learn
    return teacher, ptq


PICK = dict(steps=12, lr_scales=3e-4, eval_every=2, keep_best=True, eval_loss="distill", **{**CFG, "batch_size": 8})


def test_keep_best_picks_the_step_with_the_lowest_held_out_loss(rtn6):
    pair = rtn6
    teacher, student = _student(pair, "tied", "amax")
    held = token_ids(8, 32, seed=7)
    res = distill(student, teacher, token_ids(16, 40, seed=1), DistillConfig(**PICK), eval_tokens=held,
                  progress=False)
    losses = dict(res["eval_losses"])
    best = min(losses, key=lambda s: (losses[s], s))
    assert res["best_step"] == best and best > 0
    assert eval_distill_loss(student, teacher, held, DistillConfig(**PICK)) == losses[best]
    # the same run to that step, without selection, is the returned student bit for bit
    _, again = _student(pair, "tied", "amax")
    distill(again, teacher, token_ids(16, 40, seed=1), DistillConfig(**{**PICK, "steps": best, "keep_best": False}),
            progress=False)
    x = token_ids(2, 24)
    assert torch.equal(logits(student, x), logits(again, x))


def test_keep_best_survives_a_resume(pair, tmp_path):
    """Steps 0..6 then a resume to 12: the best of all evaluations (read back from best.pt) is kept, as in one
    uninterrupted run."""
    teacher, ptq = pair
    held = token_ids(8, 32, seed=7)
    tokens = token_ids(16, 40, seed=1)
    cfg = dict(lr_scales=3.0, eval_every=2, keep_best=True, schedule_steps=12, **CFG)
    _, whole = _student(pair)
    r_whole = distill(whole, teacher, tokens, DistillConfig(steps=12, **cfg), eval_tokens=held, progress=False)
    _, part = _student(pair)
    out = str(tmp_path / "run")
    distill(part, teacher, tokens, DistillConfig(steps=6, out_dir=out, **cfg), eval_tokens=held, progress=False)
    assert (tmp_path / "run" / "best.pt").exists()
    _, part = _student(pair)
    r_part = distill(part, teacher, tokens, DistillConfig(steps=12, out_dir=out, **cfg), eval_tokens=held,
                     resume=True, progress=False)
    assert r_part["best_step"] == r_whole["best_step"] == 0
    x = token_ids(2, 24)
    assert torch.equal(logits(part, x), logits(whole, x))


def test_keep_best_needs_evaluation_windows(pair):
    teacher, student = _student(pair)
    with pytest.raises(ValueError, match="keep_best needs eval_tokens"):
        distill(student, teacher, token_ids(8, 40), DistillConfig(steps=2, keep_best=True, **CFG), progress=False)
    with pytest.raises(ValueError, match="keep_best needs eval=True"):
        LoopConfig(steps=2, keep_best=True)
    with pytest.raises(ValueError, match="keep_best=1"):
        DistillConfig(keep_best=1)


def test_recover_holds_out_windows_and_keeps_the_best(pair):
    teacher, ptq = pair
    student = copy.deepcopy(ptq)
    tokens = token_ids(20, 40, seed=1)
    cfg = lsq.RecoveryConfig(DistillConfig(steps=4, lr_scales=3.0, eval_every=2, **CFG), holdout=4)
    res = lsq.recover(student, teacher, tokens, cfg, weights=teacher, progress=False)
    assert res.distill["best_step"] == 0
    x = token_ids(2, 24)
    assert torch.equal(logits(student, x), logits(ptq, x))
    train, held = split_holdout(tokens, 4)
    assert torch.equal(held, tokens[-4:]) and torch.equal(train, tokens[:-4])
    assert split_holdout(tokens, 0) == (tokens, None)
    with pytest.raises(ValueError, match="holdout=20: the training text gives 20 windows"):
        split_holdout(tokens, 20)
    with pytest.raises(ValueError, match="RecoveryConfig.holdout=-1; allowed values: integers >= 0"):
        lsq.RecoveryConfig(holdout=-1)
    with pytest.raises(ValueError, match="weight_units='x'"):
        lsq.RecoveryConfig(weight_units="x")
