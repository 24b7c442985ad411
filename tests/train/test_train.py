"""The trainer and its data: LR schedule, accumulation, clipping, exact resume, metrics, plots,
checkpoint errors, the stateless batch sampler, and a real 2-process torchrun (gloo) run.

Run as a script, this file is the torchrun worker of test_ddp_matches_single_process_combined_batch.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from blockscale.data.paths import data_root
from blockscale.train import (ByteTokenizer, TokenData, TrainConfig, TrainingCheckpointError, get_lr, load_data,
                              load_training_checkpoint, make_optimizer, plot_losses, read_metrics, train)
from blockscale.train.trainer import grad_norm
from tiny_training import TinyLM, small_cfg, synthetic_data, tiny_model

REPO = Path(__file__).resolve().parents[2]


def params_of(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest single-threaded (and two threads on shared cores can stall)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- data

def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "Once upon a time — naïve café ☕\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_builtin_names_resolve_through_blockscale_data(tmp_path, monkeypatch):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_bytes(b"abcdefghij" * 10)
    monkeypatch.setenv("BLOCKSCALE_DATA", str(tmp_path))
    assert data_root() == tmp_path
    d = load_data("shakespeare")
    assert d.vocab_size == 256 and d.train.dtype == torch.uint8
    assert d.train.numel() == 90 and d.val.numel() == 10  # last 10% is val, in order
    assert bytes(d.val.tolist()) == b"abcdefghij"
    with pytest.raises(FileNotFoundError, match="BLOCKSCALE_DATA"):
        load_data("tinystories")


def test_real_corpora_load():
    if not (data_root() / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip(f"shared data not found under {data_root()} (set BLOCKSCALE_DATA)")
    d = load_data("shakespeare")
    raw = (data_root() / "tinyshakespeare" / "input.txt").read_bytes()
    assert d.train.numel() + d.val.numel() == len(raw)
    assert bytes(d.train[:12].tolist()) == raw[:12] and bytes(d.val[-12:].tolist()) == raw[-12:]
    x, y = d.get_batch("val", 2, 32, step=0)
    assert x.dtype == torch.long and x.shape == (2, 32)


def test_custom_tokenizer_and_pretokenized(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 50)
    d = load_data(f, encode=lambda s: [ord(c) + 200 for c in s], vocab_size=400, val_fraction=0.2)
    assert d.vocab_size == 400 and d.train.dtype == torch.int32
    assert d.train.numel() == 480 and d.val.numel() == 120
    x, _ = d.get_batch("train", 3, 8, step=1)
    assert x.dtype == torch.long and int(x.min()) >= 200
    with pytest.raises(ValueError, match="vocab_size"):
        load_data(f, encode=lambda s: [1, 2])
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        TokenData.from_tokens(torch.tensor([1, 2, 10]), vocab_size=10)


def test_get_batch_is_a_pure_function_of_seed_step_rank():
    d = synthetic_data()
    x, y = d.get_batch("train", 4, 16, step=5, seed=1)
    x2, y2 = d.get_batch("train", 4, 16, step=5, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, d.get_batch("train", 4, 16, step=6, seed=1)[0])
    assert not torch.equal(x, d.get_batch("train", 4, 16, step=5, seed=2)[0])
    with pytest.raises(ValueError, match="too few"):
        d.get_batch("val", 1, 5000, step=0)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_batches_are_disjoint_and_union_to_the_combined_batch(world):
    d = TokenData.from_tokens(torch.arange(3000), vocab_size=3000)  # token == position: x[:, 0] is the start
    b, T = 3, 12
    for step in (0, 7):
        starts = []
        for micro in (0, 1):
            parts = [d.get_batch("train", b, T, step, rank=r, world_size=world, seed=5, micro_step=micro)
                     for r in range(world)]
            big = d.get_batch("train", b * world, T, step, rank=0, world_size=1, seed=5, micro_step=micro)
            assert torch.equal(torch.cat([p[0] for p in parts]), big[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), big[1])
            starts += [int(s) for p in parts for s in p[0][:, 0]]
        assert len(set(starts)) == 2 * b * world  # no two ranks / micro-steps share a window
    # k micro-batches of b == one batch of k*b (what makes accumulation equal a big batch)
    micro = [d.get_batch("train", b, T, 4, seed=5, micro_step=m)[0] for m in range(4)]
    assert torch.equal(torch.cat(micro), d.get_batch("train", 4 * b, T, 4, seed=5)[0])
    # a step that needs more rows than there are starts still works (each start used once per round)
    tiny = TokenData.from_tokens(torch.arange(20), vocab_size=20, val_fraction=0.0)
    x, _ = tiny.get_batch("train", 30, 10, step=0)
    assert sorted(x[:, 0].tolist()) == sorted(list(range(10)) * 3)


# ----------------------------------------------------------------------------- schedule, optimizer

def test_lr_schedule_warmup_and_cosine():
    cfg = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert get_lr(0, cfg) == pytest.approx(0.1)
    assert get_lr(4, cfg) == pytest.approx(0.5)
    assert get_lr(9, cfg) == pytest.approx(1.0)
    assert get_lr(10, cfg) == pytest.approx(1.0)  # cosine starts at lr
    assert get_lr(60, cfg) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert get_lr(110, cfg) == pytest.approx(0.1) and get_lr(500, cfg) == pytest.approx(0.1)
    decay = [get_lr(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert [get_lr(s, cfg) for s in range(10)] == pytest.approx([0.1 * (s + 1) for s in range(10)])
    assert get_lr(0, TrainConfig(steps=5, lr=0.3, warmup_steps=0)) == pytest.approx(0.3)


def test_weight_decay_only_on_matrices():
    model = tiny_model()
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    by_wd = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert all(p.dim() >= 2 for p in by_wd[0.1]) and all(p.dim() < 2 for p in by_wd[0.0])
    assert len(by_wd[0.1]) + len(by_wd[0.0]) == len(list(model.parameters()))


def test_grad_accumulation_equals_one_big_batch():
    d = synthetic_data()
    a, b = tiny_model(), tiny_model()
    ra = train(a, d, small_cfg(steps=3, batch_size=2, grad_accum=4, eval_batches=0))
    rb = train(b, d, small_cfg(steps=3, batch_size=8, grad_accum=1, eval_batches=0))
    assert ra.train_losses == pytest.approx(rb.train_losses, rel=1e-6)
    pa, pb = params_of(a), params_of(b)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6, msg=k)


class RecordingSGD(torch.optim.SGD):
    """Records the global gradient norm the optimizer sees (after clipping)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.seen: list[float] = []

    def step(self, closure=None):
        self.seen.append(float(grad_norm(p for g in self.param_groups for p in g["params"])))
        return super().step(closure)


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_clipping_caps_the_global_norm(tmp_path, clip):
    opts = []

    def factory(model, cfg):
        opts.append(RecordingSGD(model.parameters(), lr=cfg.lr))
        return opts[0]

    res = train(tiny_model(), synthetic_data(), small_cfg(tmp_path, steps=4, grad_clip=clip, eval_batches=0),
                optimizer_factory=factory)
    before = [r["grad_norm"] for r in read_metrics(res.metrics_path)]
    seen = opts[0].seen
    assert len(seen) == len(before) == 4
    if clip:
        assert all(n > clip for n in before)  # clipping was active ...
        assert seen == pytest.approx([clip] * 4, rel=1e-4)  # ... and capped the norm
    else:
        assert seen == pytest.approx(before, rel=1e-6)


def test_autocast_modes_on_cpu():
    from contextlib import nullcontext

    from blockscale.train.trainer import autocast_context

    assert autocast_context("auto", torch.device("cpu")) is nullcontext  # bf16 on CPU is opt-in
    with autocast_context("bf16", torch.device("cpu"))():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    res = train(tiny_model(), synthetic_data(), small_cfg(steps=2, autocast="bf16", eval_batches=1))
    assert all(math.isfinite(v) for v in res.train_losses + [res.final_val_loss])
    with pytest.raises(ValueError, match="autocast"):
        TrainConfig(autocast="fp16")


# ----------------------------------------------------------------------------- resume, metrics, plot

class Preempted(Exception):
    pass


class DiesAtStep:
    """Data that raises when the trainer asks for a train batch of ``step`` (a simulated kill)."""

    def __init__(self, data, step):
        self.data, self.step = data, step

    def get_batch(self, split, *args, **kw):
        step = kw["step"] if "step" in kw else args[2]
        if split == "train" and step == self.step:
            raise Preempted
        return self.data.get_batch(split, *args, **kw)


def test_exact_resume_is_bitwise(tmp_path):
    d = synthetic_data()
    cfg = dict(steps=20, grad_accum=2, ckpt_interval=5, eval_interval=5)
    straight = tiny_model(dropout=0.1)
    ra = train(straight, d, small_cfg(tmp_path / "a", **cfg))

    with pytest.raises(Preempted):  # checkpoint at step 10, metrics logged up to step 12
        train(tiny_model(dropout=0.1), DiesAtStep(d, 12), small_cfg(tmp_path / "b", **cfg))
    assert load_training_checkpoint(tmp_path / "b" / "ckpt.pt")["step"] == 10
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")][-1] == 12

    resumed = tiny_model(seed=123, dropout=0.1)  # a different init: the checkpoint must replace it
    rb = train(resumed, d, small_cfg(tmp_path / "b", **cfg), resume=True)
    assert rb.start_step == 10 and rb.step == 20
    assert rb.train_losses == ra.train_losses[10:]  # bitwise: exact float equality
    assert rb.val_losses == ra.val_losses[-2:] and rb.final_val_loss == ra.final_val_loss
    pa, pb = params_of(straight), params_of(resumed)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # the metrics file reads as one run: steps 1..20 once each, same numbers as the straight run
    ma, mb = read_metrics(ra.metrics_path), read_metrics(rb.metrics_path)
    assert [r["step"] for r in mb] == list(range(1, 21))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("elapsed_s", "tokens_per_s")} for r in rows]
    assert strip(ma) == strip(mb)
    # resuming a finished run trains nothing and reports the same val loss
    rc = train(resumed, d, small_cfg(tmp_path / "b", **cfg), resume=True)
    assert rc.train_losses == [] and rc.final_val_loss == ra.final_val_loss


def test_metrics_jsonl_is_well_formed(tmp_path):
    cfg = small_cfg(tmp_path, steps=7, log_interval=2, eval_interval=3, grad_accum=2)
    res = train(tiny_model(), synthetic_data(), cfg)
    lines = res.metrics_path.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 7]  # log_interval, eval steps, last step
    for r in rows:
        assert {"step", "lr", "train_loss", "tokens", "elapsed_s", "tokens_per_s", "grad_norm"} <= r.keys()
        assert r["tokens"] == r["step"] * 4 * 16 * 2
        assert r["lr"] == pytest.approx(get_lr(r["step"] - 1, cfg))
        assert math.isfinite(r["train_loss"]) and r["tokens_per_s"] > 0 and r["elapsed_s"] >= 0
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 7]
    assert rows[-1]["val_loss"] == res.final_val_loss and rows[-1]["train_loss"] == res.final_train_loss
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 7
    assert load_training_checkpoint(res.checkpoint_path)["step"] == 7


def test_plot_losses_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    d = synthetic_data()
    runs = {}
    for lr in (1e-2, 3e-3):
        res = train(tiny_model(), d, small_cfg(tmp_path / str(lr), lr=lr, min_lr=lr / 10))
        runs[f"lr {lr}"] = res.metrics_path
    png = plot_losses(runs, tmp_path / "plots" / "loss.png", title="two runs")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_corrupt_checkpoint_raises_a_clear_error(tmp_path):
    d = synthetic_data()
    res = train(tiny_model(), d, small_cfg(tmp_path, steps=2, eval_batches=0))
    ckpt = res.checkpoint_path
    raw = ckpt.read_bytes()
    ckpt.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TrainingCheckpointError, match="corrupt or truncated"):
        load_training_checkpoint(ckpt)
    with pytest.raises(TrainingCheckpointError, match="corrupt or truncated"):
        train(tiny_model(), d, small_cfg(tmp_path, steps=4, eval_batches=0), resume=True)
    ckpt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(TrainingCheckpointError, match="corrupt or truncated"):
        load_training_checkpoint(ckpt)
    ckpt.write_bytes(b"")
    with pytest.raises(TrainingCheckpointError, match="corrupt or truncated"):
        load_training_checkpoint(ckpt)
    torch.save({"weights": torch.zeros(2)}, ckpt)
    with pytest.raises(TrainingCheckpointError, match="not a"):
        load_training_checkpoint(ckpt)
    torch.save({"format": "blockscale.train/1", "model": ByteTokenizer()}, ckpt)  # pickled object
    with pytest.raises(TrainingCheckpointError, match="weights_only"):
        load_training_checkpoint(ckpt)
    with pytest.raises(FileNotFoundError):
        load_training_checkpoint(tmp_path / "missing.pt")


def test_checkpoint_that_does_not_fit_the_model(tmp_path):
    d = synthetic_data()
    train(tiny_model(), d, small_cfg(tmp_path, steps=2, eval_batches=0))
    with pytest.raises(TrainingCheckpointError, match="does not fit"):
        train(TinyLM(dim=8), d, small_cfg(tmp_path, steps=4, eval_batches=0), resume=True)


# ----------------------------------------------------------------------------- CLI

def test_cli_flags_map_to_train_config():
    from blockscale.cli.train import build_parser, config_from_args

    args = build_parser().parse_args(["--data", "x.txt", "--steps", "7", "--batch-size", "3", "--betas", "0.8",
                                      "0.9", "--no-progress", "--out", "runs/y", "--autocast", "none"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.batch_size, cfg.betas, cfg.progress, cfg.out_dir) == (7, 3, (0.8, 0.9), False, "runs/y")
    assert cfg.lr == TrainConfig().lr and not args.resume


def test_cli_trains_a_llama_preset(tmp_path, capsys):
    pytest.importorskip("blockscale.models.llama")
    from blockscale.cli.train import main

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    argv = ["--data", str(text), "--model-preset", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
            "--eval-batches", "1", "--log-interval", "1", "--no-progress", "--device", "cpu", "--no-plot",
            "--out", str(out)]
    assert main(argv) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert main(argv[:-2] + ["--out", str(out), "--steps", "4", "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert main(["--data", str(tmp_path / "nope.txt"), "--steps", "1"]) == 2


# ----------------------------------------------------------------------------- torchrun

DDP_CFG = dict(steps=3, seq_len=16, grad_accum=2, lr=1e-2, warmup_steps=1, eval_batches=2, eval_interval=0,
               log_interval=1, progress=False, device="cpu", autocast="none", seed=3)


def _torchrun(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests" / "support"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"torchrun timed out after {timeout} s: {' '.join(cmd)}\n--- stderr ---\n{err[-12000:]}")
    assert proc.returncode == 0, (f"torchrun failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                  f"--- stderr ---\n{proc.stderr[-12000:]}\n--- stdout ---\n{proc.stdout[-3000:]}")
    return proc


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_ddp_matches_single_process_combined_batch(tmp_path):
    out = tmp_path / "ddp"
    _torchrun([str(Path(__file__).resolve()), str(out)], cwd=tmp_path)
    ddp_state = load_training_checkpoint(out / "ckpt.pt")
    assert ddp_state["world_size"] == 2 and ddp_state["step"] == 3

    single = tiny_model()  # 2 ranks x batch 2 == one process x batch 4 (same rows, see the sampler)
    res = train(single, synthetic_data(), TrainConfig(batch_size=4, out_dir=str(tmp_path / "one"), **DDP_CFG))
    ref = params_of(single)
    for k, v in ddp_state["model"].items():
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-7, msg=k)
    ddp_rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in ddp_rows] == [1, 2, 3]
    assert [r["train_loss"] for r in ddp_rows] == pytest.approx(res.train_losses, rel=1e-6)
    assert ddp_rows[-1]["val_loss"] == pytest.approx(res.final_val_loss, rel=1e-6)
    assert ddp_rows[-1]["tokens"] == 3 * 4 * 16 * 2


def _ddp_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    train(tiny_model(), synthetic_data(), TrainConfig(batch_size=2, out_dir=out_dir, **DDP_CFG))


def test_cli_under_torchrun(tmp_path):
    pytest.importorskip("blockscale.models.llama")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _torchrun(["-m", "blockscale.train", "--data", str(text), "--steps", "3", "--batch-size", "2", "--seq-len",
               "16", "--eval-batches", "1", "--log-interval", "1", "--no-progress", "--device", "cpu",
               "--out", str(tmp_path / "r")],
              cwd=tmp_path)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["tokens"] == 3 * 2 * 16 * 2


if __name__ == "__main__":
    _ddp_worker(sys.argv[1])
    from blockscale.train.distributed import exit_process

    exit_process(0)  # a rank ends without interpreter finalisation (see exit_process)
