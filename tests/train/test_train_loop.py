"""The one training loop (blockscale.train.loop), the one next-token evaluation (blockscale.eval.next_token)
and the one tokenizer interface (blockscale.data.tokenizer)."""
from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from blockscale.data import ByteTokenizer, Tokenizer
from blockscale.eval import next_token_loss, perplexity
from blockscale.file_errors import FileWriteError
from blockscale.train import (CheckpointContents, LoopConfig, TrainingCheckpointError, TrainingDivergedError,
                              load_training_checkpoint, run_training)
from blockscale.train.trainer import evaluate
from tiny_training import small_cfg, synthetic_data, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class HeadOnlyTask:
    """A toy task: only the TinyLM's output head trains (a frozen base), plain SGD, a fixed batch stream."""

    contents = CheckpointContents("test.head-only/1", trainable_only=True)
    config = {"task": "head-only"}

    def __init__(self, data):
        self.data = data

    def trainable(self, model):
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("head."))
        return [p for p in model.parameters() if p.requires_grad]

    def make_optimizer(self, model):
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def lr(self, step):
        return None

    def step_seed(self, step, rank):
        return None

    def begin(self, start_step, info):
        pass

    def loss(self, model, step, micro, info, device):
        x, y = self.data.get_batch("train", 4, 16, step, micro_step=micro, seed=3)
        _, loss = model(x.to(device), y.to(device))
        return loss, torch.stack([loss.detach(), 2 * loss.detach()])

    def evaluate(self, model, info, device, amp, progress):
        return 0.5

    def metrics_row(self, r):
        return {"step": r.step, "loss": r.stats[0], "twice": r.stats[1], "val": r.val_loss}

    def log_line(self, r, progress):
        return None


def _loop(tmp_path, steps, **kw):
    return LoopConfig(steps=steps, grad_accum=2, log_interval=1, eval=True, eval_interval=2, out_dir=str(tmp_path),
                      ckpt_name="last.pt", progress=False, **kw)


def test_a_custom_task_trains_logs_and_resumes_exactly(tmp_path):
    """Any TrainingTask runs on the loop: only its trainable tensors change and are checkpointed, its stats
    are logged as its rows, and a run resumed after step 2 equals an uninterrupted one bit for bit."""
    data = synthetic_data()
    straight = tiny_model()
    emb0 = straight.emb.weight.detach().clone()
    res = run_training(straight, HeadOnlyTask(data), _loop(tmp_path / "a", 4), torch.device("cpu"))
    assert torch.equal(straight.emb.weight, emb0) and res.trainable_params == sum(
        p.numel() for p in straight.head.parameters())
    rows = [json.loads(line) for line in open(res.metrics_path)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["val"] for r in rows] == [None, 0.5, None, 0.5]
    assert all(r["twice"] == pytest.approx(2 * r["loss"]) for r in rows) and len(res.step_seconds) == 4

    run_training(tiny_model(), HeadOnlyTask(data), _loop(tmp_path / "b", 2), torch.device("cpu"))
    ck = HeadOnlyTask.contents.read(tmp_path / "b" / "last.pt")
    assert set(ck["trainable"]) == {"head.weight", "head.bias"} and ck["step"] == 2 and "rng" not in ck
    resumed = tiny_model()
    res2 = run_training(resumed, HeadOnlyTask(data), _loop(tmp_path / "b", 4), torch.device("cpu"), resume=True)
    assert res2.start_step == 2 and res2.train_losses == res.train_losses[2:]
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TrainingCheckpointError, match="not a blockscale.train/1 checkpoint"):
        load_training_checkpoint(tmp_path / "b" / "last.pt")


def test_the_model_gets_its_mode_back(tmp_path):
    model = tiny_model().eval()
    run_training(model, HeadOnlyTask(synthetic_data()), _loop(tmp_path, 1, train_mode=True), torch.device("cpu"))
    assert not model.training


class DivergingTask(HeadOnlyTask):
    """HeadOnlyTask whose loss is infinite from 0-based step ``bad_loss``, or whose SGD lr is infinite at
    0-based step ``bad_lr`` (finite loss and gradients, non-finite weights after the update)."""

    def __init__(self, data, bad_loss=None, bad_lr=None):
        super().__init__(data)
        self.bad_loss, self.bad_lr = bad_loss, bad_lr

    def lr(self, step):
        return float("inf") if step == self.bad_lr else 0.1

    def loss(self, model, step, micro, info, device):
        loss, stats = super().loss(model, step, micro, info, device)
        if self.bad_loss is not None and step >= self.bad_loss:
            loss = loss * float("inf")
            stats = torch.stack([loss.detach(), 2 * loss.detach()])
        return loss, stats


@pytest.mark.parametrize("bad, what, at, kept", [(dict(bad_loss=4), "the loss is inf", 5, 4),
                                                 (dict(bad_lr=3), "a trained tensor is not finite after the update", 4,
                                                  2)])
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path, bad, what, at, kept):
    """A non-finite loss stops the run before the update; non-finite weights are never checkpointed: the error
    names the step, and last.pt stays the uninterrupted run's checkpoint of the last good step."""
    data = synthetic_data()
    good = run_training(tiny_model(), DivergingTask(data), _loop(tmp_path / "good", kept), torch.device("cpu"))
    want = HeadOnlyTask.contents.read(good.checkpoint_path)
    with pytest.raises(TrainingDivergedError, match=f"training diverged at step {at}: {what}; the last good "
                       f"checkpoint, .*last.pt \\(step {kept}\\), is kept") as err:
        run_training(tiny_model(), DivergingTask(data, **bad), _loop(tmp_path / "bad", 6, ckpt_interval=2),
                     torch.device("cpu"))
    assert err.value.step == at and err.value.checkpoint == tmp_path / "bad" / "last.pt"
    got = HeadOnlyTask.contents.read(tmp_path / "bad" / "last.pt")
    assert got["step"] == kept
    assert all(torch.equal(got["trainable"][k], want["trainable"][k]) for k in want["trainable"])
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == ["last.pt", "metrics.jsonl"]


def test_a_run_diverging_before_its_first_checkpoint_says_none_was_written(tmp_path):
    with pytest.raises(TrainingDivergedError, match="at step 1: the loss is inf; no good checkpoint was written"):
        run_training(tiny_model(), DivergingTask(synthetic_data(), bad_loss=0), _loop(tmp_path, 4, ckpt_interval=2),
                     torch.device("cpu"))
    assert not (tmp_path / "last.pt").exists()


WRITERS = {  # a writer of run files, and what it writes in the child (over 256 KiB)
    "checkpoint": ("from blockscale.train.checkpoint import save_atomic as w", "w(PATH, {'w': torch.ones(1 << 20)})"),
    "text": ("from blockscale.file_errors import write_text_atomic as w", "w(PATH, 'x' * (1 << 20))"),
    "metrics": ("from blockscale.train.metrics import append_metrics as w",
                "w(pathlib.Path(PATH), {'s': 'x' * (1 << 20)})"),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_run_file_that_does_not_fit_is_one_error_naming_it(tmp_path, writer):
    """A real EFBIG (RLIMIT_FSIZE in a child process): FileWriteError naming the file (torch.save alone raised
    RuntimeError "unexpected pos ...", Python's write "[Errno 27] File too large" naming no file); the atomic
    writers leave no temporary file and the earlier file unchanged."""
    path = tmp_path / "latest.pt"
    path.write_bytes(b"earlier")
    imp, call = WRITERS[writer]
    script = textwrap.dedent(f"""
        import pathlib, torch
        {imp}
        PATH = {str(path)!r}
        try:
            {call}
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18)),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    why = (f"the file-size limit was reached (ulimit -f: {1 << 18} bytes)" if writer == "checkpoint" else
           "the file-size limit was reached (ulimit -f) or the file system cannot hold a file this large")
    assert p.stdout.strip() == f"FileWriteError could not write {path}: {why}", p.stdout + p.stderr
    assert issubclass(FileWriteError, OSError)
    if writer != "metrics":  # an append keeps what it could write
        assert path.read_bytes() == b"earlier" and sorted(x.name for x in tmp_path.iterdir()) == ["latest.pt"]


# ----------------------------------------------------------------------------- the one next-token evaluation

@torch.no_grad()
def _manual_token_loss(model, batches):
    total, count = 0.0, 0
    for x, y in batches:
        logits = model(x)[0][:, :y.shape[1]].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").double())
        count += y.numel()
    return total / count, count


def test_next_token_loss_tokens_weighting_is_the_token_mean():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    wins = torch.randint(0, 64, (5, 12), generator=g)
    batches = [(wins[:3], wins[:3, 1:]), (wins[3:], wins[3:, 1:])]  # full-window logits, the last one unscored
    assert next_token_loss(model, batches) == _manual_token_loss(model, batches)
    stream = wins.reshape(-1)
    r = perplexity(model, stream, ctx_len=12, batch_size=2)
    full = [stream[i:i + 12] for i in range(0, 60, 12)]
    wb = [torch.stack(full[i:i + 2]) for i in range(0, 5, 2)]
    loss, count = next_token_loss(model, [(b[:, :-1], b[:, 1:]) for b in wb])
    assert (r.loss, r.tokens_evaluated, r.ppl) == (loss, count, math.exp(loss))
    assert model.training  # its mode is restored


def test_next_token_loss_batches_weighting_is_pretraining_validation():
    model, data, cfg = tiny_model(), synthetic_data(), small_cfg(eval_batches=3)
    batches = [data.get_batch("val", cfg.batch_size, cfg.seq_len, step=j, seed=0) for j in range(3)]
    want = torch.zeros(())
    for x, y in batches:
        want += model(x, y)[1].float()
    assert evaluate(model, data, cfg) == (want / 3).item() == next_token_loss(model, batches, weighting="batches")[0]
    with pytest.raises(ValueError, match="weighting='mean'; allowed values: 'tokens', 'batches'"):
        next_token_loss(model, batches, weighting="mean")


# ----------------------------------------------------------------------------- the one tokenizer interface

def test_every_tokenizer_satisfies_the_interface():
    from blockscale.models.hf import ModelTokenizer

    byte = ByteTokenizer()
    wrapped = ModelTokenizer(byte.encode, bos_id=None, eos_id=None, decode_fn=byte.decode, vocab_size=256)
    for tok in (byte, wrapped):
        assert isinstance(tok, Tokenizer)
        ids = tok.encode("héllo")
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids) and tok.decode(ids) == "héllo"
        assert tok.vocab_size == 256 and tok.bos_id is None and tok.eos_id is None
    assert torch.equal(wrapped.encode_tensor("ab"), torch.tensor([97, 98]))
