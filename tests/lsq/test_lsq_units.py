"""Scale learning in units that transfer (log amax), its lr schedule, dual forms, and latent weights from PTQ."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from blockscale import lsq
from blockscale.lsq.quantizer import block_scales
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model

transformers = pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread")

FORMS = [("tied", "amax", "pair"), ("tied", "log", "pair"), ("dual", "amax", "pair"), ("dual", "log", "pair"),
         ("dual", "amax", "ratio"), ("dual", "log", "ratio")]


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _weight(scale=1.0, seed=0, shape=(8, 64)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("mode,param,form", FORMS)
def test_every_parameterisation_gives_the_same_forward_and_export_at_step0(mode, param, form):
    w = _weight()
    ref = lsq.NVFP4ScaleLearner(w, torch.tensor(3.0), init="4over6")
    other = lsq.NVFP4ScaleLearner(w, torch.tensor(3.0), mode=mode, init="4over6", param=param, dual_form=form)
    assert torch.equal(other(), ref())
    a, b = other.to_quantized(), ref.to_quantized()
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.float(), b.scales.float())
    names = {n for n, _ in other.named_parameters()} - {"weight"}
    assert names == set(other.parameter_names())


@pytest.mark.parametrize("mode,param,form", FORMS)
def test_step0_logits_equal_the_ptq_model_in_every_form(mode, param, form):
    model = tiny_hf_llama()
    quantize_model(model, PTQConfig(method="rtn", scale_rule="4over6", activations="w4a4", n_samples=4, seq_len=16),
                   token_ids(), progress=False)
    x = token_ids(2, 24, seed=3)
    before = logits(model, x)
    lsq.enable(model, mode=mode, param=param, dual_form=form)
    assert torch.equal(logits(model, x), before)
    n = 14 * (1 if mode == "tied" else 2)
    assert len(lsq.scale_parameters(model)) == n


def test_log_gradient_is_the_amax_gradient_times_the_amax():
    w = _weight(0.3)
    raw = lsq.NVFP4ScaleLearner(w, torch.tensor(5.0))
    log = lsq.NVFP4ScaleLearner(w, torch.tensor(5.0), param="log")
    g = _weight(seed=1)
    (raw() * g).sum().backward()
    (log() * g).sum().backward()
    assert torch.equal(log.log_amax.grad, raw.amax.grad * raw.amax.detach())


def _adam_step_relative_change(scale, param, lr=0.01):
    w = _weight(scale, seed=2, shape=(16, 128))
    S = torch.tensor(448.0 * 6.0) / w.abs().max()
    m = lsq.NVFP4ScaleLearner(w, S, param=param)
    before = m.amaxes()[0].detach().clone()
    opt = torch.optim.Adam([p for n, p in m.named_parameters() if n != "weight"], lr=lr)
    (m() * _weight(seed=3, shape=(16, 128))).sum().backward()
    opt.step()
    after = m.amaxes()[0].detach()
    moved = m.amaxes()[0].detach() != before
    return (after[moved] / before[moved] - 1).abs()


def test_one_lr_is_the_same_relative_step_on_every_model_in_log_units():
    """Adam's first step moves each parameter by lr (m / sqrt(v) = +-1): in log units that is a relative change
    of exp(+-lr) - 1 of every block amax whatever the weights' magnitude; raw amaxes move by lr absolute, a
    relative step 100x smaller on weights 100x larger."""
    lr = 0.01
    for scale in (0.01, 1.0):
        rel = _adam_step_relative_change(scale, "log", lr)
        assert rel.numel() > 100
        # each moved amax changed by a factor exp(+-lr) (up to Adam's eps and FP32 rounding)
        up, down = math.expm1(lr), -math.expm1(-lr)
        ok = ((rel - up).abs() < 1e-3 * up) | ((rel - down).abs() < 1e-3 * down)
        assert bool(ok.all())
    small, large = (float(_adam_step_relative_change(s, "amax", lr).median()) for s in (0.01, 1.0))
    assert small / large > 50


def test_schedule_values():
    c = lsq.DistillConfig(steps=100, lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert c.lr_factor(0) == pytest.approx(0.1) and c.lr_factor(9) == pytest.approx(1.0)
    assert c.lr_factor(10) == pytest.approx(1.0)
    assert c.lr_factor(55) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: the cosine's midpoint
    assert c.lr_factor(100) == pytest.approx(0.1) and c.lr_factor(500) == pytest.approx(0.1)
    lin = lsq.DistillConfig(steps=50, lr_schedule="linear", schedule_steps=200)
    assert lin.lr_factor(0) == 1.0 and lin.lr_factor(100) == pytest.approx(0.5) and lin.lr_factor(200) == 0.0
    assert lsq.DistillConfig(steps=5).lr_factor(3) == 1.0
    assert "lr_schedule" not in lsq.DistillConfig().to_dict()
    assert lsq.DistillConfig(lr_schedule="cosine").to_dict()["lr_schedule"] == "cosine"


@pytest.mark.parametrize("kw,word", [(dict(lr_schedule="step"), "lr_schedule"), (dict(warmup_steps=-1), "warmup_steps"),
                                     (dict(steps=10, warmup_steps=10, lr_schedule="cosine"), "warmup_steps"),
                                     (dict(min_lr_ratio=1.5), "min_lr_ratio"), (dict(schedule_steps=0), "schedule_steps"),
                                     (dict(lr_pre_factor=float("nan")), "lr_pre_factor")])
def test_bad_schedule_settings_are_refused(kw, word):
    with pytest.raises(ValueError, match=word):
        lsq.DistillConfig(**kw)


def test_bad_parameterisation_is_refused():
    with pytest.raises(ValueError, match="param="):
        lsq.NVFP4ScaleLearner(_weight(), torch.tensor(1.0), param="exp")
    with pytest.raises(ValueError, match="dual_form="):
        lsq.enable(tiny_hf_llama(), dual_form="product")


def _student_teacher():
    teacher = tiny_hf_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(method="rtn"), progress=False)
    return student, teacher


def test_distill_applies_the_schedule_to_every_group(tmp_path):
    student, teacher = _student_teacher()
    lsq.enable(student, mode="dual", weights=teacher, param="log", train_weights=True)
    cfg = lsq.DistillConfig(train="all", steps=6, lr_scales=0.02, lr_weights=1e-4, batch_size=2, seq_len=16,
                            lr_schedule="linear", warmup_steps=2, lr_pre_factor=0.5, freeze_pre_steps=3,
                            out_dir=str(tmp_path), log_every=1)
    pre = [p for n, p in student.named_parameters() if n.endswith("log_amax_pre")]
    start = [p.detach().clone() for p in pre]
    seen = []
    task_lr = lsq.DistillTask.lr

    def spy(self, step):
        task_lr(self, step)
        seen.append({g["name"]: g["lr"] for g in self.optimizer.param_groups})

    lsq.DistillTask.lr = spy
    try:
        lsq.distill(student, teacher, token_ids(8, 32), cfg, progress=False)
    finally:
        lsq.DistillTask.lr = task_lr
    for step, lrs in enumerate(seen):
        f = cfg.lr_factor(step)
        assert lrs["scales"] == pytest.approx(0.02 * f) and lrs["weights"] == pytest.approx(1e-4 * f)
        assert lrs["pre scales"] == (0.0 if step < 3 else pytest.approx(0.01 * f))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([0.02 * cfg.lr_factor(s) for s in range(6)])
    assert any(not torch.equal(a, p) for a, p in zip(start, pre))  # trained after the frozen steps


def test_pre_scales_stay_put_while_frozen():
    student, teacher = _student_teacher()
    lsq.enable(student, mode="dual", weights=teacher)
    pre = [p for n, p in student.named_parameters() if n.endswith("amax_pre")]
    post = [p for n, p in student.named_parameters() if n.endswith("amax_post")]
    a, b = [p.detach().clone() for p in pre], [p.detach().clone() for p in post]
    lsq.distill(student, teacher, token_ids(8, 32), lsq.DistillConfig(steps=2, lr_scales=0.01, batch_size=2, seq_len=16,
                                                                    freeze_pre_steps=5), progress=False)
    assert all(torch.equal(x, p) for x, p in zip(a, pre))
    assert any(not torch.equal(x, p) for x, p in zip(b, post))


def test_steps_per_scale_step_in_log_units_is_the_same_on_every_model():
    for scale in (0.01, 3.0):
        student, teacher = _student_teacher()
        with torch.no_grad():
            for p in teacher.parameters():
                p.mul_(scale)
        quantize_model(s2 := copy.deepcopy(teacher), PTQConfig(), progress=False)
        lsq.enable(s2, param="log", weights=teacher)
        med, steps = lsq.steps_per_scale_step(s2, 0.01)
        assert steps == pytest.approx(math.log1p(1 / 16) / 0.01)
        lsq.enable(raw := copy.deepcopy(student), weights=None)
        assert lsq.steps_per_scale_step(raw, 0.01)[1] == pytest.approx(0.0625 * lsq.steps_per_scale_step(raw, 0.01)[0] / 0.01)


@pytest.mark.parametrize("fields", [dict(method="awq", scale_rule="4over6"), dict(method="smoothquant"),
                                    dict(method="awq", options=AWQOptions(clip=True, grid=4)), dict(method="gptq"),
                                    dict(method="gptq", options=GPTQOptions(four_over_six="aware"),
                                         scale_rule="4over6"),
                                    dict(method="gptq", options=GPTQOptions(act_order=True), scale_rule="sweep")])
def test_latent_weights_from_ptq_keep_step0_exact(fields):
    """quantize_model(latent_weights=...) records the full-precision weights each Linear's codes are a rounding of
    (AWQ / SmoothQuant: the smoothed weights; with AWQ's clipping the clipped ones; GPTQ: the error-compensated
    column values it rounded), so scale learning re-rounds real values, not the rounded ones, and step 0 is still
    the PTQ model bit for bit."""
    teacher = tiny_hf_llama()
    student = copy.deepcopy(teacher)
    latent = {}
    quantize_model(student, PTQConfig(n_samples=8, seq_len=32, batch_size=4, **fields), token_ids(), progress=False,
                   latent_weights=latent)
    assert len(latent) == 14
    x = token_ids(2, 24, seed=5)
    before = logits(student, x)
    weights, fallback = lsq.exact_latent_weights(student, latent)
    assert fallback == []
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(weights[name], latent[name])
    assert not torch.equal(weights[name], student.get_submodule(name).dequantized_weight(torch.float32))
    assert not torch.equal(weights[name], teacher.get_submodule(name).weight)  # smoothed
    lsq.enable(student, weights=weights, param="log")
    assert torch.equal(logits(student, x), before)


def test_latent_weights_that_do_not_reproduce_the_codes_fall_back():
    teacher = tiny_hf_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(method="gptq", options=GPTQOptions(four_over_six="aware"), scale_rule="4over6",
                                      n_samples=8, seq_len=32, batch_size=4), token_ids(), progress=False)
    latent = {n: m.weight.detach() for n, m in teacher.named_modules() if isinstance(m, torch.nn.Linear)
              and n != "lm_head"}  # GPTQ's codes are not RTN of its input weight
    x = token_ids(2, 24, seed=5)
    before = logits(student, x)
    weights, fallback = lsq.exact_latent_weights(student, latent)
    assert len(fallback) == 14
    for n in fallback:
        assert torch.equal(weights[n], student.get_submodule(n).dequantized_weight(torch.float32))
    lsq.enable(student, weights=weights, param="log")
    assert torch.equal(logits(student, x), before)


def test_exact_latent_weights_rejects_a_wrong_weight():
    student, teacher = _student_teacher()
    bad = {n: torch.zeros_like(m.weight) for n, m in teacher.named_modules() if isinstance(m, torch.nn.Linear)}
    weights, fallback = lsq.exact_latent_weights(student, bad)
    assert len(fallback) == 14
    with pytest.raises(TypeError, match="candidates"):
        lsq.exact_latent_weights(student, [1])


def _w4a4_student():
    teacher = tiny_hf_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(method="rtn", activations="w4a4", n_samples=4, seq_len=16), token_ids(),
                   progress=False)
    return student, teacher


def test_learned_input_scales_start_exact_then_freeze_into_the_checkpoint_scale():
    student, teacher = _w4a4_student()
    x = token_ids(2, 24, seed=6)
    before = logits(student, x)
    lsq.enable(student, weights=teacher, param="log", learn_input_scales=True)
    assert torch.equal(logits(student, x), before)
    thetas = [p for n, p in student.named_parameters() if n.endswith("log_input_amax")]
    assert len(thetas) == 2 * 4 and all(any(p is q for q in lsq.scale_parameters(student)) for p in thetas)  # per layer: qkv, o, gate_up, down
    with torch.no_grad():
        for k, p in enumerate(thetas):
            p.fill_(-0.5 if k % 2 else 0.25)  # clip harder / looser
    moved = logits(student, x)
    assert not torch.equal(moved, before)
    lsq.freeze(student)
    assert torch.equal(logits(student, x), moved)  # the learned scale is the stored input_global_scale


def test_learned_input_scale_gradient_comes_from_saturated_blocks_only():
    from blockscale.lsq.input_scale import learned_input_quantize

    x = torch.ones(2, 32) * 0.1
    x[0, 3] = 10.0  # block 0 of row 0 exceeds alpha = 6 * 448 / S = 1
    S = torch.tensor(6.0 * 448.0 / 1.0)
    theta = torch.zeros((), requires_grad=True)
    y = learned_input_quantize(x, theta, S)
    g = torch.zeros_like(x)
    g[1] = 1.0  # only unsaturated rows get a gradient: theta's is 0
    (y * g).sum().backward()
    assert float(theta.grad) == 0.0
    theta.grad = None
    y = learned_input_quantize(x, theta, S)
    g = torch.zeros_like(x)
    g[0, 3] = -1.0  # the clipped value wants a larger alpha: dL/dtheta < 0
    (y * g).sum().backward()
    s = 448.0 / float(S)
    # u = x / s = 60 is outside: q - u * inside = 6 (the clipped code), times s
    assert float(theta.grad) == pytest.approx(-6.0 * s, rel=1e-6)


def test_learn_input_scales_needs_w4a4():
    student, teacher = _student_teacher()
    with pytest.raises(ValueError, match="learn_input_scales"):
        lsq.enable(student, learn_input_scales=True)


def _toy_dual(pre_lr_factor, mode="dual", lr=0.03, steps=100):
    """Least squares through one NVFP4 learner: inputs with channel magnitudes spread over e^(+-3), so the best
    block scales are not the RTN ones; full-batch Adam in log units, the pre amaxes at lr * pre_lr_factor."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(32, 64, generator=g)
    X = torch.randn(512, 64, generator=g) * torch.exp(1.5 * torch.randn(64, generator=g))
    Y = X @ W.T
    m = lsq.NVFP4ScaleLearner(W, torch.tensor(448 * 6.0) / W.abs().max(), mode=mode, param="log")
    names = m.parameter_names()
    groups = [{"params": [getattr(m, names[0])], "lr": lr * (pre_lr_factor if mode == "dual" else 1.0)}]
    if mode == "dual":
        groups.append({"params": [getattr(m, names[1])], "lr": lr})
    opt = torch.optim.Adam(groups)
    losses = []
    for _ in range(steps + 1):
        loss = ((X @ m().T - Y) ** 2).mean()
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_dual_with_the_write_up_lr_diverges_and_the_fix_learns():
    """The write-up's dual (pre and post at one lr) on a toy problem: dL/dpre and dL/dpost nearly cancel, Adam
    normalises each, and the codes' grid (s_pre) random-walks away from s_post: the loss more than doubles on the
    way and ends no better than it started. With the pre amaxes frozen (lr_pre_factor 0: codes from the PTQ scales,
    the learned value scale s_post) it falls steadily, below the tied result too."""
    old, fixed, tied = _toy_dual(1.0), _toy_dual(0.0), _toy_dual(1.0, mode="tied")
    assert old[0] == fixed[0] == tied[0]
    assert max(old) > 1.5 * old[0] and old[-1] > 0.9 * old[0]
    assert max(fixed) == fixed[0] and fixed[-1] < 0.75 * fixed[0]
    assert fixed[-1] < tied[-1]


def test_learn_scales_cli_from_awq_with_the_new_units(tmp_path, capsys):
    from blockscale import cli
    from blockscale.models.hf import is_blockscale_checkpoint

    out = tmp_path / "o"
    assert cli.main(["learn-scales", "stories260k", "--method", "awq", "--scale-rule", "4over6", "--w4a4",
                     "--learn-input-scales", "--mode", "dual", "--steps", "3", "--n-samples", "4", "--seq-len", "32",
                     "--batch-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "log amax" in printed
    cfg = lsq.load_distill_checkpoint(tmp_path / "o.train" / "latest.pt")["config"]
    assert cfg["lr_scales"] == 3e-3 and cfg["lr_schedule"] == "cosine" and cfg["lr_pre_factor"] == 0.0
    assert "warmup_steps" not in cfg  # 3 // 10 = 0: the default
    report = json.loads((out / "lsq_report.json").read_text())
    assert report["ptq"]["config"]["method"] == "awq"
    assert is_blockscale_checkpoint(out)


@pytest.mark.parametrize("extra,word", [(["--mode", "tied", "--lr-pre-factor", "0.5"], "--lr-pre-factor"),
                                        (["--learn-input-scales"], "--learn-input-scales"),
                                        (["--warmup-steps", "5"], "--warmup-steps")])
def test_learn_scales_cli_refuses_bad_combinations(tmp_path, capsys, extra, word):
    from blockscale import cli

    code = cli.main(["learn-scales", "stories260k", "--steps", "3", "--n-samples", "4", "--seq-len", "32",
                     "--batch-size", "2", "--out", str(tmp_path / "o")] + extra)
    err = capsys.readouterr().err
    assert code == 2 and word in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
