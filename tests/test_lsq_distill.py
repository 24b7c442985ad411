"""Quantization-aware distillation of learnable NVFP4 scales (blockscale.lsq.distill)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from blockscale import lsq
from blockscale.lsq.distill import DistillConfig, distill, distill_loss, load_distill_checkpoint
from blockscale.ptq import PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread")
tiny_llama, ids = tiny_hf_llama, token_ids


@pytest.fixture(scope="module")
def pair():
    teacher = tiny_llama()
    ptq = copy.deepcopy(teacher)
    quantize_model(ptq, PTQConfig(), progress=False)  # RTN
    return teacher, ptq


def make_student(pair, mode="tied"):
    teacher, ptq = pair
    student = copy.deepcopy(ptq)
    lsq.enable(student, mode=mode, weights=teacher)
    return teacher, student


@torch.no_grad()
def heldout_loss(student, teacher, x):
    return float(distill_loss(student(x).logits, teacher(x).logits, x)[0])


CFG = dict(batch_size=4, seq_len=32, log_every=5, max_grad_norm=1.0)


@pytest.mark.parametrize("mode,lr", [("tied", 3e-4), ("dual", 1e-4)])  # dual's two amaxes: a smaller lr
def test_scale_only_distillation_improves_and_touches_only_amax(pair, mode, lr):
    teacher, student = make_student(pair, mode)
    other = {n: p.detach().clone() for n, p in student.named_parameters()
             if n.rpartition(".")[2] not in ("amax", "amax_pre", "amax_post")}
    amax0 = [p.detach().clone() for p in lsq.scale_parameters(student)]
    held = ids(8, 32, seed=99)
    before = heldout_loss(student, teacher, held)
    res = distill(student, teacher, ids(32, 40, seed=1), DistillConfig(steps=30, lr_scales=lr, **{**CFG, "batch_size": 8}),
                  progress=False)
    after = heldout_loss(student, teacher, held)
    assert after < 0.9 * before, (before, after)
    assert res["steps"] == 30 and res["final_loss"] < res["first_loss"]
    for n, p in student.named_parameters():
        if n in other:
            assert torch.equal(p, other[n]), n
    assert not all(torch.equal(a, p) for a, p in zip(amax0, lsq.scale_parameters(student)))
    n_scales = sum(p.numel() for p in lsq.scale_parameters(student))
    assert res["trainable_params"] == n_scales
    n_tensors = len(amax0)  # Adam: exp_avg + exp_avg_sq (FP32) + a scalar step per tensor
    assert 8 * n_scales <= res["optimizer_state_bytes"] <= 8 * n_scales + 8 * n_tensors
    assert res["metrics_path"] is None and res["seconds_per_step"] > 0
    assert all(not p.requires_grad for p in teacher.parameters())


def test_all_mode_trains_latent_weights_with_two_groups(pair, monkeypatch):
    teacher, student = make_student(pair)
    w0 = [p.detach().clone() for p in lsq.weight_parameters(student)]
    emb0 = student.model.embed_tokens.weight.detach().clone()
    seen = {}
    real = torch.optim.AdamW

    def spy(groups, **kw):
        opt = real(groups, **kw)
        seen["groups"] = [(g["name"], g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        return opt

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    res = distill(student, teacher, ids(16, 32, seed=2),
                  DistillConfig(train="all", steps=3, lr_scales=1e-3, lr_weights=1e-4, ce_weight=0.5,
                                temperature=2.0, **CFG), progress=False)
    assert seen["groups"] == [("scales", 1e-3, 0.0, 14), ("weights", 1e-4, 0.0, 14)]
    assert all(not torch.equal(a, p) for a, p in zip(w0, lsq.weight_parameters(student)))
    assert torch.equal(student.model.embed_tokens.weight, emb0)
    n = sum(p.numel() for p in lsq.scale_parameters(student)) + sum(w.numel() for w in w0)
    assert res["trainable_params"] == n


def test_exact_resume(pair, tmp_path):
    tokens = ids(16, 40, seed=3)
    cfg = dict(lr_scales=1e-3, grad_accum=2, **CFG)
    teacher, straight = make_student(pair)
    distill(straight, teacher, tokens, DistillConfig(steps=6, **cfg), progress=False)

    _, s2 = make_student(pair)
    out = str(tmp_path / "run")
    distill(s2, teacher, tokens, DistillConfig(steps=3, out_dir=out, **cfg), progress=False)
    ck = load_distill_checkpoint(tmp_path / "run" / "latest.pt")
    assert ck["step"] == 3 and set(ck["trainable"]) == {n for n, p in s2.named_parameters() if p.requires_grad}
    _, resumed = make_student(pair)  # fresh model: everything trainable comes from the checkpoint
    res = distill(resumed, teacher, tokens, DistillConfig(steps=6, out_dir=out, **cfg), resume=True,
                  progress=False)
    assert res["steps"] == 6
    for a, b in zip(lsq.scale_parameters(straight), lsq.scale_parameters(resumed)):
        assert torch.equal(a, b)
    assert [r["step"] for r in map(json.loads, open(res["metrics_path"]))] == [3, 5, 6]


def test_metrics_plot_and_eval(pair, tmp_path):
    teacher, student = make_student(pair)
    res = distill(student, teacher, ids(16, 32, seed=4),
                  DistillConfig(steps=5, lr_scales=1e-3, batch_size=2, seq_len=16, log_every=2, eval_every=4,
                                out_dir=str(tmp_path)),
                  eval_tokens=ids(4, 16, seed=5), progress=True)
    rows = [json.loads(line) for line in open(res["metrics_path"])]
    assert [r["step"] for r in rows] == [2, 4, 5]
    assert all({"step", "loss", "kl", "ce", "lr", "seconds"} <= set(r) for r in rows)
    assert "eval_loss" in rows[1] and "eval_loss" in rows[2] and "eval_loss" not in rows[0]
    assert (tmp_path / "losses.png").stat().st_size > 0 and (tmp_path / "latest.pt").exists()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("bad", [dict(train="weights"), dict(steps=0), dict(lr_scales=0.0), dict(lr_scales=-1.0),
                                 dict(temperature=0), dict(ce_weight=-0.1), dict(batch_size=0), dict(grad_accum=0),
                                 dict(seq_len=1), dict(max_grad_norm=-1), dict(eval_every=-1), dict(log_every=0),
                                 dict(steps=2.5), dict(lr_scales=float("nan")), dict(train="all", lr_weights=0.0)])
def test_bad_config_raises(bad):
    name = next(iter(k for k in bad if k != "train")) if len(bad) > 1 or "train" not in bad else "train"
    with pytest.raises(ValueError, match=f"DistillConfig.{name}="):
        DistillConfig(**bad)


def test_bad_inputs_raise(pair, tmp_path):
    teacher, ptq = pair
    with pytest.raises(ValueError, match="no LSQLinear"):
        distill(copy.deepcopy(ptq), teacher, ids(4, 32), DistillConfig(seq_len=16), progress=False)
    _, student = make_student(pair)
    with pytest.raises(ValueError, match="seq_len"):
        distill(student, teacher, ids(4, 8), DistillConfig(seq_len=16), progress=False)
    with pytest.raises(ValueError, match="resume"):
        distill(student, teacher, ids(4, 32), DistillConfig(seq_len=16), resume=True, progress=False)


def test_learn_scales_cli_on_stories260k(tmp_path, capsys):
    """RTN-initialised scale learning from the command line: the exported checkpoint scores exactly what
    the trained model scored; a PTQ checkpoint directory works as input too (teacher from its metadata)."""
    import json

    from blockscale import cli

    out = tmp_path / "learned"
    common = ["--skip-indivisible", "--steps", "6", "--n-samples", "16", "--seq-len", "64", "--lr-scales", "1e-3",
              "--eval", "tinystories#0:0.02"]
    assert cli.main(["learn-scales", "stories260k", "--mode", "dual", "--out", str(out)] + common) == 0
    rep = json.loads((out / "lsq_report.json").read_text())
    before, after = rep["perplexity"]["before"], rep["perplexity"]["after"]
    assert after["loss"] < before["loss"]
    assert cli.main(["eval", "ppl", str(out), "--data", "tinystories#0:0.02", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["loss"] == after["loss"]
    ptq = tmp_path / "gptq"
    assert cli.main(["quantize", "stories260k", "--method", "gptq", "--skip-indivisible", "--n-samples", "8",
                     "--seq-len", "64", "--out", str(ptq)]) == 0
    assert cli.main(["learn-scales", str(ptq), "--out", str(tmp_path / "learned2"), "--steps", "2", "--n-samples", "8",
                     "--seq-len", "64"]) == 0
    assert (tmp_path / "learned2" / "model.safetensors").is_file()
