"""``lsq.quantize_student`` + ``lsq.recover`` used directly (no command line): the run ``blockscale learn-scales``
makes of the same settings, bit for bit, and the hooks in their documented order."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from blockscale import cli, lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.export import export_checkpoint
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import default_texts

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, N_SAMPLES, SEQ_LEN, BATCH, LR = 8, 4, 32, 2, 0.01  # an lr that moves scales by E4M3 steps


def _tensors(ckpt) -> dict:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _library_run(tmp_path, events: list):
    lm = load_model("stories260k")
    texts = default_texts("stories260k")
    ptq = PTQConfig(method="rtn", scale_rule="6", activations="w4a16", skip_indivisible=True, n_samples=N_SAMPLES,
                    seq_len=SEQ_LEN)
    qs = lsq.quantize_student(lm.model, lm.tokenizer, ptq, texts.calib, texts.calib_bos, progress=False)
    assert qs.dequantized == [] and len(qs.weights) > 0  # RTN: every latent weight is the one PTQ rounded
    assert qs.model is not lm.model and qs.report.to_dict()["config"]["method"] == "rtn"
    dcfg = lsq.DistillConfig(steps=STEPS, lr_scales=LR, batch_size=BATCH, seq_len=SEQ_LEN,
                             lr_schedule="cosine", lr_pre_factor=0.0, ckpt_every=1, out_dir=str(tmp_path / "lib.train"))
    measure = lsq.perplexity_evaluator(lm.tokenizer, texts.eval, texts.ctx, texts.bos, max_tokens=2048)

    def evaluate(model, tag):
        events.append(tag)
        return measure(model, tag)

    def tokens():
        events.append("tokens")
        return calibration_batches(lm.tokenizer, texts.calib, N_SAMPLES, SEQ_LEN, seed=0, bos=texts.calib_bos)

    result = lsq.recover(qs.model, lm.model, tokens, lsq.RecoveryConfig(dcfg), weights=qs.weights, evaluate=evaluate,
                         on_enabled=lambda m: events.append(("enabled", len(lsq.lsq_layers(m)), len(qs.weights))),
                         progress=False)
    return lm, qs, result


def test_recover_is_the_learn_scales_run_bit_for_bit(tmp_path, capsys):
    events = []
    lm, qs, result = _library_run(tmp_path, events)
    assert events[0][0] == "enabled" and events[0][1] > 0 and events[1:] == ["tokens", "before", "after"]
    # the latent weights were cloned into the LSQ layers: recover hands the dict's copies back before training (a
    # second FP32 copy of every quantized weight, 1.4 GB on a 0.5B model, was held through training and evaluation)
    assert events[0][2] == 0 and qs.weights == {}
    assert result.main_rank and result.distill["steps"] == STEPS
    before, after = result.evaluations["before"], result.evaluations["after"]
    assert before["tokens_evaluated"] == after["tokens_evaluated"] > 0
    assert after["ppl"] != before["ppl"], result.evaluations  # the scales moved (by whole E4M3 steps)
    assert result.distill["final_loss"] < 0.5 * result.distill["first_loss"], result.distill  # distillation works
    assert not lsq.lsq_layers(qs.model)  # frozen: plain quantized modules again, ready to export
    lib = export_checkpoint(qs.model, tmp_path / "lib", tokenizer=lm.tokenizer.hf)

    out = tmp_path / "cli"
    assert cli.main(["learn-scales", "stories260k", "--skip-indivisible", "--steps", str(STEPS), "--lr-scales", str(LR), "--n-samples",
                     str(N_SAMPLES), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--ckpt-interval", "1",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    mine, theirs = _tensors(lib), _tensors(out)
    assert mine.keys() == theirs.keys() and len(mine) > 0
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    lib_state = lsq.load_distill_checkpoint(tmp_path / "lib.train" / "latest.pt")
    cli_state = lsq.load_distill_checkpoint(tmp_path / "cli.train" / "latest.pt")
    assert lib_state["step"] == cli_state["step"] == STEPS


def test_recover_reports_enable_refusals_as_scale_setup_errors():
    lm = load_model("stories260k")  # full precision: no NVFP4 layer to make trainable
    with pytest.raises(lsq.ScaleSetupError, match="quantize it first") as info:
        lsq.recover(lm.model, lm.model, torch.zeros(1, 8, dtype=torch.long),
                    lsq.RecoveryConfig(lsq.DistillConfig(steps=1, seq_len=8)))
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)


def test_learning_from_gptq_moves_from_the_first_steps():
    """GPTQ's latent weights are the column values it rounded, not its dequantized weights: a dequantized weight
    sits at the centre of its rounding interval and a stored scale at the centre of its E4M3 one, so at the
    recovery lr (1e-3 per step, a relative step) no code and no scale moved in 50 steps on SmolLM2-135M (the
    held-out loss stayed 0.1849 to 4 digits and best-step selection returned the GPTQ model). From the rounded
    values the held-out loss changes from the first step."""
    lm = load_model("stories260k")
    texts = default_texts("stories260k")
    ptq = PTQConfig(method="gptq", activations="w4a16", skip_indivisible=True, n_samples=8, seq_len=128)
    qs = lsq.quantize_student(lm.model, lm.tokenizer, ptq, texts.calib, texts.calib_bos, progress=False)
    assert qs.dequantized == []  # every latent weight reproduces GPTQ's codes
    tokens = calibration_batches(lm.tokenizer, texts.calib, 16, 64, seed=1, bos=texts.calib_bos)
    dcfg = lsq.recovery_distill_config(3, lr_scales=1e-3, lr_weights=1e-3, seq_len=64, eval_every=1)
    result = lsq.recover(qs.model, lm.model, tokens, lsq.RecoveryConfig(dcfg, holdout=8), weights=qs.weights,
                         progress=False)
    losses = [v for _, v in result.distill["eval_losses"]]
    assert len(losses) == 4 and all(v != losses[0] for v in losses[1:]), losses
