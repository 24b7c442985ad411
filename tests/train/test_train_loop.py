"""The one training loop (blockscale.train.loop), the one next-token evaluation (blockscale.eval.next_token)
and the one tokenizer interface (blockscale.data.tokenizer)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from blockscale.data import ByteTokenizer, Tokenizer
from blockscale.eval import next_token_loss, perplexity
from blockscale.train import (CheckpointContents, LoopConfig, TrainingCheckpointError, load_training_checkpoint,
                              run_training)
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
