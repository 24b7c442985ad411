"""Expert parallelism in the trainer (``train(..., expert_parallel=CommConfig(...))``, ``blockscale train
--expert-parallel``) under a real 2-process torchrun (gloo), against one process on the combined batch.

The single-process reference is the same ``train`` call in one process: its MoE layers keep every
expert and emulate the wire payloads (``decode(encode(x))``, bit for bit the value the all-to-alls
deliver), so it is the W-rank run's exact counterpart up to reduction order. Run as a script, this
file is the torchrun worker.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale.models.llama import Llama, LlamaConfig
from blockscale.nn.moe import MoE, MoEConfig
from blockscale.nn.moe_parallel import CommConfig, ExpertParallelMoE, global_load_balancing_loss
from blockscale.train import TokenData, TrainConfig, load_training_checkpoint, read_metrics, train

REPO = Path(__file__).resolve().parents[2]
D = 32
MODEL = LlamaConfig(dim=D, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=64, max_seq_len=32,
                    moe=MoEConfig(n_experts=4, top_k=2))
COMMS = {"bf16": CommConfig(),
         "nvfp4-s2f6": CommConfig(dispatch="nvfp4", combine="s2f6", dispatch_grad="mxfp8", combine_grad="mxfp8", seed=3),
         "nvfp4-mxfp8": CommConfig(dispatch="nvfp4", combine="mxfp8", combine_grad="mxfp8")}
# 3 steps of 2 micro steps; per rank batch 2 (the reference: batch 4 in one process, the same rows).
# A constant LR, so a 2-step run resumed to 3 steps is the 3-step run.
BASE = dict(steps=3, seq_len=16, grad_accum=2, lr=1e-2, min_lr=1e-2, warmup_steps=0, eval_batches=1,
            eval_interval=0, log_interval=1, progress=False, device="cpu", autocast="none", seed=3, plot=False)

if __name__ != "__main__":  # the workers run on one thread; so must the reference (same GEMM reductions)
    pytestmark = pytest.mark.usefixtures("one_thread")


def data() -> TokenData:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(6000) % 13 * 5 % 64
    noise = torch.randint(0, 64, (6000,), generator=g)
    return TokenData.from_tokens(torch.where(torch.rand(6000, generator=g) < 0.8, base, noise), vocab_size=64)


def model(n_experts: int = 4) -> Llama:
    return Llama(dataclasses.replace(MODEL, moe=MoEConfig(n_experts=n_experts, top_k=2)), seed=0)


def aux_inputs(n: int = 24):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, D, generator=g)


def aux_moe() -> MoE:
    torch.manual_seed(0)
    return MoE(D, 48, MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.5))


def first_batch():
    return data().get_batch("train", 4, 16, 0, rank=0, world_size=1, seed=3, micro_step=0)


def first_forward(comm: str, x, y):
    """(logits, loss) of a training-mode forward with the experts sharded over the ranks of the job
    (one process: all experts, emulated payloads)."""
    from blockscale.nn.moe_parallel import to_expert_parallel

    m = model()
    to_expert_parallel(m, COMMS[comm], global_aux=True)
    m.train()
    logits, loss = m(x, y)
    return logits.detach(), loss.detach()


# ----------------------------------------------------------------------------- the torchrun worker

def _worker(out: str) -> None:
    torch.distributed.init_process_group("gloo")  # train() joins it (and leaves it to us)
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    out = Path(out)
    results = {}
    for name, comm in COMMS.items():
        train(model(), data(), TrainConfig(batch_size=2, out_dir=str(out / name), **BASE), expert_parallel=comm)
    # resume: 2 steps, then resumed to 3 == 3 steps uninterrupted (the "bf16" run)
    train(model(), data(), TrainConfig(batch_size=2, out_dir=str(out / "cut"), **{**BASE, "steps": 2}),
          expert_parallel=COMMS["bf16"])
    train(model(), data(), TrainConfig(batch_size=2, out_dir=str(out / "cut"), **BASE), resume=True,
          expert_parallel=COMMS["bf16"])
    # the first forward of the whole Llama: this rank's 2 of the 4 rows
    x, y = first_batch()
    results["logits"] = {}
    for name in COMMS:
        results["logits"][name] = first_forward(name, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    # the load-balancing loss: this rank's 12 of 24 tokens, global and local
    x = aux_inputs()[12 * rank:12 * rank + 12]
    for scope in ("global", "local"):
        layer = ExpertParallelMoE(aux_moe(), CommConfig(), global_aux=scope == "global")
        layer(x.view(1, 12, D))
        layer.aux_loss.backward()
        g = layer.router.weight.grad.clone()
        torch.distributed.all_reduce(g)  # what DDP does to the replicated router: the mean over ranks
        results[scope] = (layer.aux_loss.detach(), g / 2)
    plan, p = aux_moe().router.route(x)
    results["no_tokens"] = float(global_load_balancing_loss(aux_moe().router, p[:0], plan.counts * 0))
    # 3 experts over 2 ranks: refused before any collective
    try:
        train(model(3), data(), TrainConfig(batch_size=2, **{**BASE, "steps": 1}), expert_parallel=CommConfig())
        results["indivisible"] = None
    except ValueError as exc:
        results["indivisible"] = f"{type(exc).__name__}: {exc}"
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _torchrun(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"torchrun failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                  f"--- stderr ---\n{proc.stderr[-12000:]}\n--- stdout ---\n{proc.stdout[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    out = tmp_path_factory.mktemp("ep_train")
    _torchrun([str(Path(__file__).resolve()), str(out)], cwd=out)
    return out


def _reference(tmp_path, comm, **kw):
    torch.set_num_threads(1)
    m = model()
    res = train(m, data(), TrainConfig(batch_size=4, out_dir=str(tmp_path), **{**BASE, **kw}), expert_parallel=comm)
    return res, load_training_checkpoint(tmp_path / "ckpt.pt")


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("comm", list(COMMS))
def test_ep_train_steps_equal_one_process_on_the_combined_batch(ep_run, tmp_path, comm):
    """3 steps x 2 micro steps, 2 ranks x batch 2 == one process x batch 4 with the same payloads
    (emulated): losses, the updated parameters (every expert gathered into the checkpoint) and the AdamW
    moments. The forward is bit for bit (test_first_forward_is_bit_exact); the backward is not: DDP's
    gradient mean, the cross-entropy mean, the load-balancing sums and the gradient norm are reduced in
    another order (~1e-7 relative), and a gradient payload (bf16 / MXFP8 rows) now and then turns such a
    difference into one ulp of its format (2^-8 for bf16), which AdamW's first steps (update ~ lr * sign)
    pass on. Bound: a one-ulp change of a bf16 gradient (relative 2^-8) changes an Adam update
    m/sqrt(v) by at most ~2 x 2^-8 of its size (~1), i.e. a parameter by lr x 2^-7 per step: 3 x 1e-2 x
    2^-7 = 2.3e-4 after 3 steps. Measured after 3 steps at lr 1e-2: parameters within 5e-5 on one machine
    and 1.2e-4 (one element of 8192) on another (bf16 payloads; 4e-7 with NVFP4 / MXFP8), exp_avg within
    1e-6, exp_avg_sq within 2% relative; losses within 1e-6 relative. Asserted: parameters atol 2.3e-4
    (all payloads bf16; rtol = atol = 1e-4 otherwise), exp_avg atol 1e-5, exp_avg_sq rtol 5e-2, losses 1e-6."""
    res, ref = _reference(tmp_path / "one", COMMS[comm])
    got = load_training_checkpoint(ep_run / comm / "ckpt.pt")
    assert got["world_size"] == 2 and got["step"] == 3
    assert got["record"]["expert_parallel"] == {**COMMS[comm].__dict__}
    assert set(got["model"]) == set(ref["model"])
    all_bf16 = COMMS[comm] == CommConfig()  # every payload bf16: the loose bound of the docstring
    tol = dict(rtol=0.0, atol=BASE["steps"] * BASE["lr"] * 2**-7) if all_bf16 else dict(rtol=1e-4, atol=1e-4)
    for k, v in ref["model"].items():
        assert got["model"][k].shape == v.shape, k  # the full model: 4 experts, not 2
        torch.testing.assert_close(got["model"][k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")
    assert got["model"]["layers.0.feed_forward.experts.w1"].shape[0] == 4
    for i, s in ref["optimizer"]["state"].items():
        torch.testing.assert_close(got["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["optimizer"]["state"][i]["exp_avg_sq"], s["exp_avg_sq"], rtol=5e-2, atol=1e-12)
    rows = read_metrics(ep_run / comm / "metrics.jsonl")
    assert [r["train_loss"] for r in rows] == pytest.approx(res.train_losses, rel=1e-6)
    assert rows[-1]["val_loss"] == pytest.approx(res.final_val_loss, rel=1e-6)
    # and the model really moved
    start = model().state_dict()
    assert not torch.equal(got["model"]["layers.1.feed_forward.experts.w2"], start["layers.1.feed_forward.experts.w2"])


@pytest.mark.parametrize("comm", list(COMMS))
def test_first_forward_is_bit_exact(ep_run, comm):
    """The whole Llama's training forward on 2 ranks (2 rows each) gives the logits of one process on the
    4 rows bit for bit, for every payload (rows reach each expert in the same order; the wire formats are
    exactly their emulation); the loss (CE mean + global aux) to the order of its mean (1e-6)."""
    x, y = first_batch()
    want_logits, want_loss = first_forward(comm, x, y)
    ranks = [torch.load(ep_run / f"rank{r}.pt", weights_only=False)["logits"][comm] for r in range(2)]
    assert torch.equal(torch.cat([r[0] for r in ranks]), want_logits)
    torch.testing.assert_close((ranks[0][1] + ranks[1][1]) / 2, want_loss, rtol=1e-6, atol=0)


def test_quantized_payloads_stay_close_to_the_unquantized_moe(ep_run, tmp_path):
    """NVFP4 dispatch with S2F6 or MXFP8 combine: the 2-rank losses stay within 2% of a plain FP32 MoE
    trained on the combined batch (no expert parallelism at all), and differ from the bf16 payload run
    (the payloads are applied)."""
    plain = train(model(), data(), TrainConfig(batch_size=4, **BASE))
    bf16 = [r["train_loss"] for r in read_metrics(ep_run / "bf16" / "metrics.jsonl")]
    assert bf16 == pytest.approx(plain.train_losses, rel=2e-3)  # bf16 rows on the wire: ~3 digits
    for comm in ("nvfp4-s2f6", "nvfp4-mxfp8"):
        losses = [r["train_loss"] for r in read_metrics(ep_run / comm / "metrics.jsonl")]
        assert losses == pytest.approx(plain.train_losses, rel=2e-2), comm
        assert losses != bf16


def test_resume_equals_uninterrupted(ep_run):
    """A 2-rank run stopped after step 2 (full-model checkpoint) and resumed to step 3 writes the same
    checkpoint as the uninterrupted 3-step run, bit for bit (model, AdamW state)."""
    full = load_training_checkpoint(ep_run / "bf16" / "ckpt.pt")
    cut = load_training_checkpoint(ep_run / "cut" / "ckpt.pt")
    assert full["step"] == cut["step"] == 3
    for k, v in full["model"].items():
        assert torch.equal(cut["model"][k], v), k
    for i, s in full["optimizer"]["state"].items():
        for key, v in s.items():
            assert torch.equal(cut["optimizer"]["state"][i][key], v), (i, key)
    assert [r["train_loss"] for r in read_metrics(ep_run / "cut" / "metrics.jsonl")] == \
        [r["train_loss"] for r in read_metrics(ep_run / "bf16" / "metrics.jsonl")]


def test_resume_on_one_process_from_a_two_rank_checkpoint(ep_run, tmp_path):
    """The checkpoint is the single-process layout: one process with expert parallelism (all experts)
    resumes the 2-rank 2-step checkpoint and continues like the 2-rank run (same global batch)."""
    import shutil

    shutil.copytree(ep_run / "bf16", tmp_path / "r")
    state = load_training_checkpoint(tmp_path / "r" / "ckpt.pt")
    assert state["model"]["layers.0.feed_forward.experts.w1"].shape == (4, 64, D)
    m = model()
    res = train(m, data(), TrainConfig(batch_size=4, out_dir=str(tmp_path / "r"), **{**BASE, "steps": 4}),
                resume=True, expert_parallel=CommConfig())
    assert res.start_step == 3 and len(res.train_losses) == 1 and res.final_train_loss < 5


def test_load_balancing_loss_is_over_the_global_batch(ep_run):
    """Each rank's aux loss (global_aux) equals the single-process loss on the 24 tokens of both ranks
    (rtol 1e-6: the token sums are added per rank first), and the mean over ranks of its router
    gradient equals the single-process gradient. The per-rank loss (global_aux=False) differs."""
    moe = aux_moe()
    x = aux_inputs()
    moe(x.view(1, 24, D))
    want = moe.aux_loss
    want.backward()
    want_grad = moe.router.weight.grad
    ranks = [torch.load(ep_run / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        aux, grad = res["global"]
        torch.testing.assert_close(aux, want.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    local = [float(res["local"][0]) for res in ranks]
    assert all(abs(v - float(want.detach())) > 1e-4 for v in local), (local, float(want.detach()))
    assert ranks[0]["no_tokens"] == 0.0


def test_experts_not_divisible_by_the_world_size_are_refused(ep_run):
    for r in range(2):
        msg = torch.load(ep_run / f"rank{r}.pt", weights_only=False)["indivisible"]
        assert msg is not None and msg.startswith("UsageError")
        assert "n_experts=3" in msg and "world size 2" in msg


def test_train_refuses_what_expert_parallelism_cannot_run():
    from blockscale.errors import UsageError

    cfg = TrainConfig(batch_size=2, **{**BASE, "steps": 1, "eval_batches": 0})
    dense = Llama(dataclasses.replace(MODEL, moe=None), seed=0)
    with pytest.raises(UsageError, match="needs a model with MoE layers"):
        train(dense, data(), cfg, expert_parallel=CommConfig())
    with pytest.raises(UsageError, match="must be a blockscale.nn.moe_parallel.CommConfig"):
        train(model(), data(), cfg, expert_parallel="nvfp4")
    m = model()
    train(m, data(), cfg, expert_parallel=CommConfig())  # one process: every expert, emulated payloads
    with pytest.raises(UsageError, match="expert-parallel already"):
        train(m, data(), cfg, expert_parallel=CommConfig())


def test_cli_refuses_bad_expert_parallel_flags(tmp_path, monkeypatch, capsys):
    from blockscale.cli.train import main

    text = tmp_path / "t.txt"
    text.write_text("abc " * 200)
    base = ["--data", str(text), "--steps", "1", "--device", "cpu", "--no-progress"]
    cases = [(["--dispatch", "nvfp4"], "--dispatch needs --expert-parallel"),
             (["--expert-parallel", "--combine", "nvfp4"], "--combine nvfp4: expected one of bf16, mxfp8, s2f6"),
             (["--expert-parallel"], "--model-preset tiny is dense")]
    for extra, match in cases:
        assert main(base + extra) == 2, extra
        assert match in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # --fsdp itself needs >= 2 processes
    assert main(base + ["--expert-parallel", "--model-preset", "tiny-moe", "--fsdp"]) == 2
    assert "cannot be combined with --fsdp" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")  # checked before joining any job
    assert main(base + ["--expert-parallel", "--model-preset", "tiny-moe"]) == 2
    err = capsys.readouterr().err
    assert "n_experts=8" in err and "world size 3" in err


def test_cli_under_torchrun(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    proc = _torchrun(["-m", "blockscale.train", "--data", str(text), "--model-preset", "tiny-moe", "--steps", "2",
                      "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--log-interval", "1",
                      "--no-progress", "--device", "cpu", "--expert-parallel", "--dispatch", "nvfp4", "--combine",
                      "s2f6", "--out", str(tmp_path / "r")], cwd=tmp_path)
    assert "done: step 2" in proc.stdout
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["tokens"] == 2 * 2 * 16 * 2
    state = load_training_checkpoint(tmp_path / "r" / "ckpt.pt")
    assert state["model"]["layers.1.feed_forward.experts.w2"].shape == (8, 32, 64)  # all 8 experts
    assert state["record"]["expert_parallel"]["dispatch"] == "nvfp4"


if __name__ == "__main__":
    _worker(sys.argv[1])
    from blockscale.train.distributed import exit_process

    exit_process(0)  # a rank ends without interpreter finalisation (see exit_process)
