"""Issue 13 (new-user experience) on the command line: built-in models quantize with no extra flag,
one line per condition (no Python source lines), kernel compiles announced once, defaults the tool
agrees with, and --help texts that show every choice and default."""
import copy
import json

import pytest

from blockscale import cli

DOWN_PROJ = [f"model.layers.{i}.mlp.down_proj" for i in range(5)]  # in_features 172 in stories260K


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_builtin_quantizes_without_flags(method, tmp_path, capsys):
    out = tmp_path / "q"
    args = ["quantize", "stories260k", "--method", method, "--n-samples", "8", "--seq-len", "64", "--out", str(out)]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "ptq_report.json").read_text())["ptq"]
    assert report["kept_high_precision"][:5] == DOWN_PROJ and report["config"]["skip_indivisible"] is True
    lines = [ln for ln in err.splitlines() if "not a multiple of 16" in ln]
    assert len(lines) == 1, err  # ONE line for the skipped Linears, not one per PTQ warning
    assert lines[0].startswith("blockscale quantize: warning: kept 5 Linear(s) in high precision")
    assert "model.layers.*.mlp.down_proj (5)" in lines[0] and "--no-skip-indivisible" in lines[0]
    assert "RuntimeWarning" not in err and "warnings.warn" not in err


def test_no_skip_indivisible_names_cli_flags(tmp_path, capsys):
    assert cli.main(["quantize", "stories260k", "--no-skip-indivisible", "--out", str(tmp_path / "q")]) == 1
    err = capsys.readouterr().err
    assert "in_features=172 is not a multiple of 16" in err
    assert "--skip-indivisible" in err and "--exclude" in err and "skip_indivisible=" not in err
    assert not (tmp_path / "q").exists()


# ----------------------------------------------------------------------------- no silent minutes

def test_compile_notice_printed_once_and_suppressible(monkeypatch, capsys):
    import torch

    from blockscale.quant import backend
    from blockscale.quant.fast_kernel import fast_kernel

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # no real compile: the notice, not its timing
    monkeypatch.setitem(backend._state, "compile_announced", False)
    monkeypatch.setitem(backend._state, "compile_failed", False)
    monkeypatch.delenv("BLOCKSCALE_QUIET", raising=False)
    inc, dbl = fast_kernel(lambda x: x + 1), fast_kernel(lambda x: x * 2)
    assert capsys.readouterr().err == ""  # wrapping compiles nothing
    with backend.use_backend("compiled"):  # only the foreground compile announces itself
        assert (inc(1), inc(2), dbl(3)) == (2, 3, 6)
    assert capsys.readouterr().err.splitlines() == ["blockscale: compiling kernels (first run only) ..."]
    monkeypatch.setitem(backend._state, "compile_announced", False)
    monkeypatch.setenv("BLOCKSCALE_QUIET", "1")
    with backend.use_backend("compiled"):
        assert fast_kernel(lambda x: -x)(1) == -1
    assert capsys.readouterr().err == ""


def _tiny_run(tmp_path, **kw):
    from blockscale.train import TrainConfig
    from tiny_training import synthetic_data, tiny_model

    cfg = dict(steps=3, batch_size=2, seq_len=16, warmup_steps=1, eval_batches=2, log_interval=1, progress=False,
               device="cpu", autocast="none", out_dir=str(tmp_path / "run"))
    return tiny_model(), synthetic_data(), TrainConfig(**{**cfg, **kw})


def test_evaluation_has_its_own_progress_bar(tmp_path, capsys):
    from blockscale.train.trainer import evaluate

    model, data, cfg = _tiny_run(tmp_path)
    evaluate(model, data, cfg)
    assert "validation" not in capsys.readouterr().err  # off unless asked
    evaluate(model, data, cfg, progress=True)
    assert "validation" in capsys.readouterr().err and "2/2" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- defaults the tool agrees with

def test_learn_scales_default_lr_moves_scales_on_stories260k(stories260k_copy):
    """The default units are log amaxes (--param log): Adam moves each log amax by about --lr-scales per step,
    so at the default 3e-3 a block scale can move by one E4M3 step (a relative change of 1/16) after
    ln(1 + 1/16) / 3e-3 = 20.2 steps on every model, under --steps 100: the hint stays quiet. In the
    write-up's raw units (--param amax) the stories260K RTN model's median block amax 0.2399 gives
    0.0625 * 0.2399 / 3e-3 = 5.0 steps at that default, and 150 steps (> 100: the hint fires) at 1e-4."""
    import math

    from blockscale import lsq
    from blockscale.cli.learn_scales import DEFAULT_LR_SCALES, DEFAULT_LR_SCALES_LOG, default_lr_scales, scales_stuck
    from blockscale.lsq import RECOVERY_LR_SCALES, RECOVERY_LR_WEIGHTS
    from blockscale.ptq import PTQConfig
    from blockscale.ptq.quantize_model import quantize_model

    args = cli.build_parser().parse_args(["learn-scales", "stories260k", "--out", "x"])
    assert args.lr_scales is None and args.param == "log" and args.lr_schedule == "cosine" and args.steps == 100
    assert args.mode == "dual" and args.lr_pre_factor is None and args.train == "scales"  # value scales on the PTQ grid
    assert default_lr_scales("log") == DEFAULT_LR_SCALES_LOG == RECOVERY_LR_SCALES == 3e-3
    assert default_lr_scales("amax") == DEFAULT_LR_SCALES == 3e-3
    from blockscale.cli.learn_scales import default_lr_weights

    # the recovery pipeline's, in units of each block's scale (docs/results/recovery-defaults.md)
    assert args.lr_weights is None and args.weight_units == "block"
    assert default_lr_weights("block") == RECOVERY_LR_WEIGHTS == 3e-3
    lm = stories260k_copy
    with pytest.warns(RuntimeWarning, match="not a multiple of 16"):
        quantize_model(lm.model, PTQConfig(skip_indivisible=True), progress=False)
    raw = copy.deepcopy(lm.model)
    lsq.enable(lm.model, mode="tied", init="stored", param="log")
    med, n = lsq.steps_per_scale_step(lm.model, DEFAULT_LR_SCALES_LOG)
    assert n == pytest.approx(math.log1p(1 / 16) / 3e-3) and not scales_stuck(n, args.steps)
    lsq.enable(raw, mode="tied", init="stored", param="amax")
    med, n = lsq.steps_per_scale_step(raw, DEFAULT_LR_SCALES)
    assert med == pytest.approx(MEDIAN_AMAX_STORIES, rel=1e-3)
    assert n == pytest.approx(5.0, abs=0.05) and not scales_stuck(n, args.steps)
    assert lsq.steps_per_scale_step(raw, 1e-4)[1] == pytest.approx(150, abs=1)
    assert scales_stuck(lsq.steps_per_scale_step(raw, 1e-4)[1], args.steps)


MEDIAN_AMAX_STORIES = 0.2399


def test_learn_scales_report_without_eval_has_no_perplexity(tmp_path, capsys):
    out = tmp_path / "l"
    assert cli.main(["learn-scales", "stories260k", "--steps", "1", "--n-samples", "4", "--seq-len", "32",
                     "--batch-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    # default --lr-scales 3e-3 in log units: ~20 steps per scale step, more than this run's --steps 1: the hint fires
    assert "--lr-scales 0.003 (Adam moves each log amax" in printed.out and "needs ~20 steps" in printed.out
    assert "consider a larger --lr-scales" in printed.out
    assert "not a multiple of 16" in printed.err  # built-in: skipped by default, one line
    report = json.loads((out / "lsq_report.json").read_text())
    assert "perplexity" not in report
    meta = json.loads((out / "config.json").read_text())
    assert "perplexity" in json.dumps(meta) and '"perplexity": {}' not in json.dumps(meta)


def test_warmup_not_shorter_than_run_warns(tmp_path):
    from blockscale.train import train

    model, data, cfg = _tiny_run(tmp_path, warmup_steps=100, out_dir=None)
    with pytest.warns(RuntimeWarning, match=r"warmup_steps 100 >= steps 3: the learning rate never reaches"):
        train(model, data, cfg)


def test_train_cli_warns_on_warmup_and_reports_finished_resume(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", "shakespeare", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--eval-batches", "1", "--no-progress", "--no-plot", "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    warn_lines = [ln for ln in captured.err.splitlines() if "warmup" in ln]
    assert warn_lines == [ln for ln in warn_lines if ln.startswith("blockscale train: warning: warmup_steps 100 "
                                                                   ">= steps 2")] and len(warn_lines) == 1
    assert "RuntimeWarning" not in captured.err
    assert cli.main(argv + ["--resume"]) == 0
    printed = capsys.readouterr().out
    assert "already finished at step 2" in printed and "None" not in printed


# ----------------------------------------------------------------------------- outputs

def test_train_writes_loss_png(tmp_path):
    pytest.importorskip("matplotlib")
    from blockscale.train import train

    model, data, cfg = _tiny_run(tmp_path)
    result = train(model, data, cfg)
    assert result.plot_path == tmp_path / "run" / "loss.png" and result.plot_path.stat().st_size > 1000
    model, data, cfg = _tiny_run(tmp_path / "b", plot=False)
    assert train(model, data, cfg).plot_path is None and not (tmp_path / "b" / "run" / "loss.png").exists()


def test_demo_says_where_it_writes(tmp_path, monkeypatch, capsys):
    from blockscale.cli import demo

    monkeypatch.setattr(demo, "_run", lambda *a, **k: 0)
    monkeypatch.chdir(tmp_path)
    assert demo.run_demo(out_dir="runs/demo") == 0
    assert f"to {tmp_path.resolve() / 'runs' / 'demo'}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --help

def _subparsers(parser, prefix=()):
    import argparse

    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, prefix + (name,))


def _all_parsers():
    from blockscale.cli.train import build_parser as train_parser

    out = [(cmd, p) for cmd, p in _subparsers(cli.build_parser()) if cmd != ("train",)]
    return out + [(("train",), train_parser())]


@pytest.mark.parametrize("cmd,parser", _all_parsers(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_help_shows_every_default_and_choice(cmd, parser):
    import re

    from blockscale.cli.reporting import default_text, shows_default

    text = parser.format_help()
    flat = " ".join(text.split())
    for action in parser._actions:
        if not action.option_strings:
            continue
        block = _option_help(text, action)
        if action.choices:
            assert all(str(c) in block for c in action.choices), (cmd, action.option_strings)
        if shows_default(action):
            shown = default_text(action.default)
            assert shown in re.findall(r"[^\s(),:;]+", block) or f"(default: {shown})" in block, \
                (cmd, action.option_strings, block)
    assert parser.description or cmd == (), cmd
    assert flat.startswith("usage: blockscale"), flat[:40]


def _option_help(text: str, action) -> str:
    """The help block of ``action``: from its option line up to the next option line."""
    lines = text.splitlines()
    flag = action.option_strings[0]
    for i, ln in enumerate(lines):
        if ln.strip().startswith(flag + " ") or ln.strip() == flag or ln.strip().startswith(flag + ","):
            block = [ln]
            for nxt in lines[i + 1:]:
                if nxt.strip().startswith("-"):
                    break
                block.append(nxt)
            return " ".join(" ".join(block).split())
    raise AssertionError(f"{flag} not in the help")


def test_train_help_usage_and_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: blockscale train")
    assert "--model-preset {tiny,small,stories260k" in out and "--autocast {auto,bf16,none}" in out


def test_distill_evaluation_has_its_own_progress_bar(capsys):
    import torch

    from blockscale.lsq.distill import eval_next_token_loss
    from tiny_training import TinyLM

    class Logits(TinyLM):
        def forward(self, idx, targets=None):
            return super().forward(idx)[0]

    torch.manual_seed(0)
    model, tokens = Logits(), torch.randint(0, 64, (4, 9))
    quiet = eval_next_token_loss(model, tokens, batch_size=2)
    assert "evaluation" not in capsys.readouterr().err
    assert eval_next_token_loss(model, tokens, batch_size=2, progress=True) == quiet
    assert "evaluation" in capsys.readouterr().err
