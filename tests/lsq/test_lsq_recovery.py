"""The recovery pipeline's settings (``lsq.recovery``): one source for ``blockscale demo`` and ``learn-scales``."""
import pytest

from blockscale import cli, lsq


def test_recovery_distill_config_values_and_overrides():
    cfg = lsq.recovery_distill_config(50)
    assert (cfg.steps, cfg.train, cfg.lr_scales, cfg.lr_weights, cfg.lr_pre_factor) == (50, "all", 3e-3, 3e-3, 0.0)
    assert cfg.eval_every == 10 and not cfg.keep_best  # (selection needs the held-out windows: distill's eval_tokens)
    assert (cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr_ratio, cfg.batch_size, cfg.seq_len) == ("cosine", 5, 0.0, 4, 128)
    assert lsq.RECOVERY_ENABLE == {"mode": "dual", "param": "log", "dual_form": "pair", "weight_units": "block"}
    assert lsq.RECOVERY_HOLDOUT == 16
    # the schedule: warm-up to the peak at step 4, cosine down to 0 at step 50
    assert cfg.lr_factor(0) == pytest.approx(0.2) and cfg.lr_factor(4) == 1.0 and cfg.lr_factor(5) == 1.0
    assert cfg.lr_factor(50) == 0.0
    small = lsq.recovery_distill_config(7, train="scales", out_dir="runs/x")
    assert small.train == "scales" and small.out_dir == "runs/x" and small.warmup_steps == 0
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="steps="):
            lsq.recovery_distill_config(bad)
    with pytest.raises(ValueError, match="lr_schedule"):
        lsq.recovery_distill_config(10, lr_schedule="step")


def test_demo_and_learn_scales_defaults_are_the_pipeline_settings():
    demo = cli.build_parser().parse_args(["demo"])
    assert (demo.best, demo.lsq_steps, demo.lsq_train) == ("hessian", 50, "all")
    assert (demo.lsq_lr, demo.lsq_lr_weights) == (lsq.RECOVERY_LR_SCALES, lsq.RECOVERY_LR_WEIGHTS)
    ls = cli.build_parser().parse_args(["learn-scales", "m", "--out", "o"])
    assert (ls.mode, ls.param, ls.dual_form, ls.weight_units) == tuple(lsq.RECOVERY_ENABLE.values())
    from blockscale.cli.learn_scales import lr_weights

    assert ls.lr_weights is None and lr_weights(ls) == lsq.RECOVERY_LR_WEIGHTS
