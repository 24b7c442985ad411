"""The learning-rate retry of scale learning (``DistillConfig.lr_retries``): when the held-out best step is the
start, the start is put back and the run repeated at a third of every learning rate."""
from __future__ import annotations

import copy

import pytest
import torch

from blockscale import lsq
from blockscale.lsq.distill import LR_RETRY_FACTOR, DistillConfig, distill, retry_config

transformers = pytest.importorskip("transformers")
from tiny_models import llama_and_its_4over6_ptq, logits, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(batch_size=4, seq_len=32, log_every=5, max_grad_norm=0.0, eval_every=2, keep_best=True,
           eval_loss="distill", train="all")
HELD = dict(seed=7)


@pytest.fixture(scope="module")
def pair():
    return llama_and_its_4over6_ptq()


def _student(pair):
    teacher, ptq = pair
    student = copy.deepcopy(ptq)
    lsq.enable(student, mode="dual", init="stored", weights=teacher, param="log", weight_units="block")
    return student


def _run(pair, cfg, **kw):
    student = _student(pair)
    res = distill(student, pair[0], token_ids(16, 40, seed=1), cfg, eval_tokens=token_ids(8, 32, **HELD),
                  progress=False, **kw)
    return student, res


# lr 3 (scales, log units) and 3 (weights, block units) per step: every step is worse than the start
TOO_LARGE = dict(steps=6, lr_scales=3.0, lr_weights=3.0, **CFG)


def test_a_retry_is_the_run_at_a_third_of_the_learning_rates_from_the_start(pair, tmp_path):
    """Attempt 1 never beats the start (best step 0): the student is put back to the start and trained again at
    lr / 3, with a fresh optimizer and the same batches; the result is that run's bit for bit, and its files are
    in out_dir/retry-1."""
    out = tmp_path / "run"
    student, res = _run(pair, DistillConfig(**TOO_LARGE, lr_retries=1, out_dir=str(out)))
    first, second = res["attempts"]
    assert first["best_step"] == 0 and min(v for s, v in first["eval_losses"] if s) > first["eval_losses"][0][1]
    assert (first["lr_scales"], first["lr_weights"]) == (3.0, 3.0)
    assert (second["lr_scales"], second["lr_weights"]) == (1.0, 1.0)
    assert second["out_dir"] == str(out / "retry-1") and (out / "retry-1" / "latest.pt").exists()
    assert (out / "latest.pt").exists()
    # the direct run at a third of the learning rates, no retry
    direct, want = _run(pair, DistillConfig(**{**TOO_LARGE, "lr_scales": 1.0, "lr_weights": 1.0}))
    assert res["eval_losses"] == want["eval_losses"] and res["best_step"] == want["best_step"]
    assert second["eval_losses"] == want["eval_losses"] and second["best_step"] == want["best_step"]
    assert res["eval_losses"][0] == first["eval_losses"][0]  # the same start, evaluated again
    x = token_ids(2, 24)
    assert torch.equal(logits(student, x), logits(direct, x))


def test_no_retry_when_learning_beats_the_start(pair):
    cfg = dict(steps=6, lr_scales=3e-3, lr_weights=3e-3, **CFG)
    student, res = _run(pair, DistillConfig(**cfg, lr_retries=1))
    assert res["best_step"] > 0 and len(res["attempts"]) == 1
    plain, want = _run(pair, DistillConfig(**cfg))
    assert "attempts" not in want and want["eval_losses"] == res["eval_losses"]
    x = token_ids(2, 24)
    assert torch.equal(logits(student, x), logits(plain, x))


def test_retries_stop_after_lr_retries_and_keep_the_start(pair):
    """Every attempt worse than the start: lr_retries=2 gives three attempts (lr, lr/3, lr/9), then the student is
    the start bit for bit."""
    cfg = dict(TOO_LARGE, lr_scales=9.0, lr_weights=9.0)
    student, res = _run(pair, DistillConfig(**cfg, lr_retries=2))
    assert [a["lr_scales"] for a in res["attempts"]] == [9.0, 3.0, 1.0]
    assert [a["best_step"] for a in res["attempts"]] == [0, 0, 0]
    x = token_ids(2, 24)
    assert torch.equal(logits(student, x), logits(_student(pair), x))


def test_no_retry_without_selection(pair):
    cfg = dict(TOO_LARGE, keep_best=False)
    _, res = _run(pair, DistillConfig(**cfg, lr_retries=1))
    assert len(res["attempts"]) == 1 and res["best_step"] is None


def test_an_interrupted_retry_resumes_to_the_uninterrupted_result(pair, tmp_path):
    """The first attempt finished (its checkpoint at the last step), the retry not started: a resumed run finds
    attempt 1 finished with the start as its best, and runs the retry; the student equals an uninterrupted run."""
    out = str(tmp_path / "run")
    whole, want = _run(pair, DistillConfig(**TOO_LARGE, lr_retries=1))
    _run(pair, DistillConfig(**TOO_LARGE, out_dir=out))  # (attempt 1 only)
    resumed, res = _run(pair, DistillConfig(**TOO_LARGE, lr_retries=1, out_dir=out), resume=True)
    assert [a["best_step"] for a in res["attempts"]][0] == 0 and len(res["attempts"]) == 2
    assert res["eval_losses"] == want["eval_losses"]
    x = token_ids(2, 24)
    assert torch.equal(logits(resumed, x), logits(whole, x))
    # resumed again: both attempts finished, nothing trains, the same student
    again, res2 = _run(pair, DistillConfig(**TOO_LARGE, lr_retries=1, out_dir=out), resume=True)
    assert res2["best_step"] == res["best_step"] and torch.equal(logits(again, x), logits(whole, x))


def test_retry_config_and_validation():
    cfg = DistillConfig(lr_scales=3e-3, lr_weights=6e-3, out_dir="runs/x", lr_retries=2)
    r2 = retry_config(cfg, 2)
    assert r2.lr_scales == 3e-3 / LR_RETRY_FACTOR ** 2 and r2.lr_weights == 6e-3 / LR_RETRY_FACTOR ** 2
    assert r2.out_dir.replace("\\", "/") == "runs/x/retry-2" and retry_config(DistillConfig(), 1).out_dir is None
    assert LR_RETRY_FACTOR == 3.0
    assert "lr_retries" not in DistillConfig().to_dict() and cfg.to_dict()["lr_retries"] == 2
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="lr_retries"):
            DistillConfig(lr_retries=bad)
    assert lsq.recovery_distill_config(50).lr_retries == lsq.RECOVERY_LR_RETRIES == 1


def test_no_gradient_is_left_on_the_student(pair):
    """The last step's gradients are one more copy of every trained tensor: distill drops them, after a retry too
    (they would stay through the caller's evaluation and export)."""
    student, res = _run(pair, DistillConfig(**TOO_LARGE, lr_retries=1))
    assert len(res["attempts"]) == 2
    trained = [p for p in student.parameters() if p.requires_grad]
    assert trained and all(p.grad is None for p in trained)
