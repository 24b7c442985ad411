"""Quantization-aware distillation of learnable NVFP4 scales (blockscale.lsq.distill).

Run as a script, this file is the torchrun worker of test_distill_under_torchrun_matches_single_process.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale import lsq
from blockscale.lsq.distill import DistillConfig, distill, distill_loss, load_distill_checkpoint
from blockscale.ptq import PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402
if __name__ != "__main__":
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
    the trained model scored; a PTQ checkpoint directory works as input too (teacher from its metadata, with
    --teacher-from-metadata)."""
    import json

    from blockscale import cli

    out = tmp_path / "learned"
    common = ["--skip-indivisible", "--steps", "6", "--n-samples", "16", "--seq-len", "64", "--lr-scales", "1e-2",
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
    assert cli.main(["learn-scales", str(ptq), "--teacher-from-metadata", "--out", str(tmp_path / "learned2"),
                     "--steps", "2", "--n-samples", "8", "--seq-len", "64"]) == 0
    assert (tmp_path / "learned2" / "model.safetensors").is_file()


@pytest.mark.parametrize("mode", ["tied", "dual"])
def test_w4a4_gradients_reach_every_amax(mode):
    """W4A4: the input quantizer passes gradients straight through, so every Linear's amaxes get a
    gradient (a plain fake_quantize would stop it at the next quantized Linear's input); the forward
    stays the PTQ model's bit for bit."""
    teacher = tiny_llama()
    ptq = copy.deepcopy(teacher)
    quantize_model(ptq, PTQConfig(activations="w4a4"), calibration=ids(8, 32, seed=7), progress=False)
    student = copy.deepcopy(ptq)
    lsq.enable(student, mode=mode, weights=teacher)
    x = ids(2, 24, seed=8)
    with torch.no_grad():
        assert torch.equal(student(x).logits, ptq(x).logits)
    for p in lsq.scale_parameters(student):
        p.requires_grad_(True)
    distill_loss(student(x).logits, teacher(x).logits, x)[0].backward()
    for name, p in student.named_parameters():
        if name.rpartition(".")[2] in ("amax", "amax_pre", "amax_post"):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_steps_per_scale_step_reports_the_median_amax(pair):
    _, student = make_student(pair)
    amax = torch.cat([p.detach().flatten() for p in lsq.scale_parameters(student)])
    med, steps = lsq.steps_per_scale_step(student, 1e-4)
    assert med == float(amax.median()) and steps == pytest.approx(med / 16 / 1e-4)
    with pytest.raises(ValueError, match="no LSQ amax"):
        lsq.steps_per_scale_step(pair[1], 1e-4)


# ----------------------------------------------------------------------------- torchrun

TORCHRUN_CFG = dict(train="all", steps=3, lr_scales=1e-3, lr_weights=1e-4, grad_accum=2, seq_len=24, log_every=1,
                    eval_every=3, seed=5)


def _torchrun_student():
    teacher = tiny_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(activations="w4a4"), calibration=ids(8, 32, seed=7), progress=False)
    lsq.enable(student, mode="dual", weights=teacher)
    return teacher, student


def _torchrun_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    teacher, student = _torchrun_student()
    distill(student, teacher, ids(16, 32, seed=6), DistillConfig(batch_size=2, out_dir=out_dir, **TORCHRUN_CFG),
            eval_tokens=ids(4, 24, seed=9), progress=False)


def _torchrun(args, cwd):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo / "tests" / "support"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed: {' '.join(cmd)}\n{proc.stderr[-8000:]}"
    return proc


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_distill_under_torchrun_matches_single_process(tmp_path):
    """2 gloo ranks x batch 2 (DDP over the trainable amaxes and latent weights of a W4A4 dual model)
    == one process x batch 4: the same rows (stateless sampler), gradients averaged over ranks."""
    _torchrun([str(Path(__file__).resolve()), str(tmp_path / "ddp")], tmp_path)
    ddp = load_distill_checkpoint(tmp_path / "ddp" / "latest.pt")
    assert ddp["step"] == 3 and ddp["world_size"] == 2

    teacher, single = _torchrun_student()
    res = distill(single, teacher, ids(16, 32, seed=6), DistillConfig(batch_size=4, out_dir=str(tmp_path / "one"),
                                                                      **TORCHRUN_CFG),
                  eval_tokens=ids(4, 24, seed=9), progress=False)
    ref = {n: p.detach() for n, p in single.named_parameters() if p.requires_grad}
    assert set(ddp["trainable"]) == set(ref) and any(n.endswith("amax_pre") for n in ref)
    for n, v in ddp["trainable"].items():
        torch.testing.assert_close(v, ref[n], rtol=1e-5, atol=1e-6, msg=n)
    rows = [json.loads(line) for line in open(tmp_path / "ddp" / "metrics.jsonl")]
    one = [json.loads(line) for line in open(res["metrics_path"])]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert rows[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_learn_scales_cli_under_torchrun(tmp_path):
    """`torchrun -m blockscale.cli learn-scales`: both ranks train, rank 0 alone evaluates and exports."""
    import blockscale as bs

    out = tmp_path / "learned"
    proc = _torchrun(["-m", "blockscale.cli", "learn-scales", "stories260k", "--skip-indivisible", "--steps", "3",
                      "--n-samples", "8", "--seq-len", "64", "--batch-size", "2", "--lr-scales", "1e-3",
                      "--eval", "tinystories#0:0.01", "--out", str(out)], tmp_path)
    assert proc.stdout.count("wrote compressed-tensors checkpoint") == 1
    rep = json.loads((out / "lsq_report.json").read_text())
    assert rep["distill"]["steps"] == 3 and set(rep["perplexity"]) == {"before", "after"}
    ck = load_distill_checkpoint(out.parent / "learned.train" / "latest.pt")
    assert ck["world_size"] == 2 and ck["step"] == 3
    model = bs.load(out)
    assert sum(1 for m in model.modules() if type(m).__name__ == "NVFP4Linear") > 0


if __name__ == "__main__":
    _torchrun_worker(sys.argv[1])
    from blockscale.train.distributed import exit_process

    exit_process(0)  # a rank ends without interpreter finalisation (see exit_process)
