"""``ptq.oneshot``, the library call under ``blockscale quantize``: the same checkpoint as the command line for the
same settings, torchrun's other ranks write nothing, and bad input fails before any work."""
from __future__ import annotations

import json
import struct

import pytest

from blockscale import cli
from blockscale.errors import UsageError
from blockscale.nn import NVFP4Linear
from blockscale.ptq import OneshotResult, PerplexityEval, PTQConfig, oneshot

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

EVAL = "tinystories#0:0.05"


def _without_timing(d: dict) -> dict:
    return {k: _without_timing(v) if isinstance(v, dict) else v for k, v in d.items() if k != "seconds"}


def _contents(ckpt) -> tuple:
    """The safetensors file's tensor bytes and header, and config.json, all but what records the run's time:
    ``seconds`` in config.json and so its digest in the safetensors metadata (``blockscale.config_sha256``)."""
    raw = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    del header["__metadata__"]["blockscale.config_sha256"]
    return raw[8 + n:], header, _without_timing(json.loads((ckpt / "config.json").read_text()))


def test_oneshot_writes_the_checkpoint_of_blockscale_quantize(tmp_path, capsys, stories260k_copy):
    by_cli = tmp_path / "cli"
    assert cli.main(["quantize", "stories260k", "--method", "gptq", "--w4a4", "--n-samples", "8", "--seq-len", "64",
                     "--eval", EVAL, "--max-eval-tokens", "2048", "--out", str(by_cli)]) == 0
    printed = capsys.readouterr().out
    lm = stories260k_copy
    lines = []
    # the command line's settings for stories260k: its calibration text (with BOS) and evaluation defaults
    cfg = PTQConfig(method="gptq", activations="w4a4", n_samples=8, seq_len=64, skip_indivisible=True)
    result = oneshot(lm.model, lm.tokenizer, cfg, "tinystories#0.8:1", tmp_path / "lib", calib_bos=True,
                     evaluation=PerplexityEval(EVAL, 512, "stream", 2048), model_name="stories260k", progress=False,
                     log=lines.append)
    assert isinstance(result, OneshotResult) and result.main_rank and result.path == tmp_path / "lib"
    assert _contents(result.path) == _contents(by_cli)
    assert sorted(p.name for p in result.path.iterdir()) == sorted(p.name for p in by_cli.iterdir())
    assert len(lines) == 1 and lines[0] in printed.splitlines()  # the perplexity line the command prints
    ours, theirs = (json.loads((d / "ptq_report.json").read_text()) for d in (result.path, by_cli))
    assert ours["model"] == theirs["model"] == "stories260k"
    assert _without_timing(ours["perplexity"]) == _without_timing(theirs["perplexity"])
    assert ours["ptq"]["config"] == theirs["ptq"]["config"] and len(result.report.linears) == 30


def test_oneshot_on_a_torchrun_rank_other_than_0_writes_nothing(tmp_path, monkeypatch, stories260k_copy):
    monkeypatch.setenv("RANK", "1")
    lm = stories260k_copy
    result = oneshot(lm.model, lm.tokenizer, PTQConfig(skip_indivisible=True), "unused", tmp_path / "q",
                     evaluation=PerplexityEval(EVAL, 512), progress=False)
    assert not result.main_rank and result.path is None and result.perplexity is None
    assert len(result.report.linears) == 30 and not (tmp_path / "q").exists()


@pytest.mark.parametrize("kw,error,match", [
    (dict(format="safetensors"), UsageError, r"format='safetensors'; supported: 'compressed-tensors'"),
    (dict(tokenizer=None), ValueError, r"method='rtn' / activations='w4a4' calibrates on text, but this model has no "
                                       r"tokenizer"),
    (dict(calibration_bos=True), TypeError, r"unexpected keyword argument 'calibration_bos'")])
def test_oneshot_refuses_before_any_work(tmp_path, stories260k_copy, kw, error, match):
    lm = stories260k_copy
    kw = dict(tokenizer=lm.tokenizer) | kw
    with pytest.raises(error, match=match):
        oneshot(lm.model, config=PTQConfig(activations="w4a4", skip_indivisible=True), calibration="tinystories",
                out=tmp_path / "q", progress=False, **kw)
    assert not any(isinstance(m, NVFP4Linear) for m in lm.model.modules()) and not (tmp_path / "q").exists()
