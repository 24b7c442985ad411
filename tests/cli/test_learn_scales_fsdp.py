"""``blockscale learn-scales --fsdp`` building student and teacher shard by shard (issue 31) under a real
2-process torchrun (gloo, CPU), against the single-process run; the sharding flags."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from cli_runs import run_cli  # noqa: E402
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = ["--steps", "3", "--lr-scales", "0.2", "--scale-rule", "hessian", "--train", "all", "--n-samples", "8",
       "--seq-len", "32", "--ckpt-interval", "0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 3-layer Llama with a character tokenizer, as a transformers directory."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("lsq_fsdp") / "tiny"
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    chars = [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)
    return d


def _torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "blockscale.cli", "learn-scales", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


SELECTING = ["--n-samples", "24", "--holdout", "4", "--select-every", "1"]  # (later flags win)


RETRYING = SELECTING + ["--lr-scales", "3", "--lr-weights", "3"]  # (never beats the start: a retry at lr 1 / 1)


@pytest.mark.parametrize("selection", [False, True, "retry"], ids=["last-step", "held-out-best-step", "lr-retry"])
def test_fsdp_run_built_shard_by_shard_equals_the_single_process_run(tmp_path, model_dir, capsys, selection):
    """Hessian-aware RTN initialisation, scales and latent weights trained for 3 steps: the checkpoint
    exported by 2 FSDP2 ranks (student streamed and sharded layer by layer, teacher read row by row; 1 window
    per rank) is the single-process one (2 windows per step) byte for byte, and the losses agree. With
    best-step selection on 4 held-out windows (2 per rank) both pick the same step (each rank restores its
    shards of it). With learning rates too large to beat the start, both retry at a third of them (the sharded
    student put back to its start shard by shard) and agree again."""
    run = RUN + (RETRYING if selection == "retry" else SELECTING if selection else [])
    code, out, err = run_cli(["learn-scales", model_dir, "--out", tmp_path / "single", "--batch-size", "2", *run],
                             capsys)
    assert code == 0, err
    proc = _torchrun(tmp_path, str(model_dir), "--out", str(tmp_path / "fsdp"), "--batch-size", "1", "--fsdp", *run)
    assert proc.returncode == 0, proc.stdout[-4000:] + "\n=====\n" + proc.stderr[-6000:]
    assert "wrote compressed-tensors checkpoint" in proc.stdout and "loading it whole" not in proc.stdout
    single, sharded = _tensors(tmp_path / "single"), _tensors(tmp_path / "fsdp")
    assert sorted(single) == sorted(sharded)
    for k, t in single.items():
        assert torch.equal(t, sharded[k]), k
    a, b = (json.loads((tmp_path / d / "lsq_report.json").read_text())["distill"] for d in ("single", "fsdp"))
    for key in ("first_loss", "final_loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-5)
    assert b["optimizer_state_bytes"] < a["optimizer_state_bytes"]  # each rank holds its shard of Adam's state
    if selection:
        assert [s for s, _ in a["eval_losses"]] == [s for s, _ in b["eval_losses"]] == [0, 1, 2, 3]
        assert [v for _, v in b["eval_losses"]] == pytest.approx([v for _, v in a["eval_losses"]], rel=1e-5)
        assert a["best_step"] == b["best_step"] and a["best_step"] is not None
        assert sorted(p.name for p in (tmp_path / "fsdp.train").glob("best*.pt")) == ["best.rank0.pt", "best.rank1.pt"]
        assert [(x["lr_scales"], x["best_step"]) for x in a["attempts"]] == [(x["lr_scales"], x["best_step"])
                                                                           for x in b["attempts"]]
        if selection == "retry":
            assert [(x["lr_scales"], x["best_step"]) for x in b["attempts"]][0] == (3, 0) and len(b["attempts"]) == 2


def test_a_checkpoint_input_with_a_bf16_teacher_and_activation_checkpointing(tmp_path, model_dir, capsys):
    """A quantized checkpoint (enabled and sharded block by block), the teacher read row by row in bf16
    (--teacher-dtype), activation checkpointing: the 2-rank run exports the single-process run's checkpoint."""
    code, _, err = run_cli(["learn-scales", model_dir, "--out", tmp_path / "ckpt", "--steps", "1",
                            "--n-samples", "4", "--seq-len", "32"], capsys)
    assert code == 0, err
    flags = ["--teacher", str(model_dir), "--teacher-dtype", "bf16", "--activation-checkpointing", "--steps", "3",
             "--lr-scales", "0.2", "--n-samples", "8", "--seq-len", "32", "--ckpt-interval", "0"]
    code, _, err = run_cli(["learn-scales", tmp_path / "ckpt", "--out", tmp_path / "single", "--batch-size", "2",
                            *flags], capsys)
    assert code == 0, err
    proc = _torchrun(tmp_path, str(tmp_path / "ckpt"), "--out", str(tmp_path / "fsdp"), "--batch-size", "1",
                     "--fsdp", *flags)
    assert proc.returncode == 0, proc.stdout[-4000:] + "\n=====\n" + proc.stderr[-6000:]
    single, sharded = _tensors(tmp_path / "single"), _tensors(tmp_path / "fsdp")
    assert sorted(single) == sorted(sharded)
    for k, t in single.items():
        assert torch.equal(t, sharded[k]), k
    assert not all(torch.equal(t, _tensors(tmp_path / "ckpt")[k]) for k, t in single.items())  # scales moved


def _args(**kw):
    base = dict(fsdp=True, model="stories260k", fsdp_cpu_offload=False)
    return argparse.Namespace(**{**base, **kw})


def test_a_source_that_cannot_be_sharded_says_so_in_one_line(model_dir):
    from blockscale.cli.learn_scales_sharded import sharding_note

    assert sharding_note(_args(model=str(model_dir)), False, str(model_dir)) == (True, True, None)
    assert sharding_note(_args(model=str(model_dir), fsdp=False), False, str(model_dir)) == (False, False, None)
    student, teacher, note = sharding_note(_args(), False, "stories260k")
    assert (student, teacher) == (False, False)
    assert note == ("--fsdp: stories260k: stories260k is not a transformers checkpoint; loading it whole on every "
                    "rank before sharding")


def test_cpu_offload_needs_fsdp_and_a_gpu(tmp_path, model_dir, capsys, monkeypatch):
    base = ["learn-scales", model_dir, "--out", tmp_path / "o", "--fsdp-cpu-offload"]
    code, _, err = run_cli(base, capsys)
    assert code == 2 and err.strip().splitlines() == [
        "blockscale learn-scales: error: --fsdp-cpu-offload is FSDP2's offload policy: add --fsdp (under torchrun)"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_cli(base + ["--fsdp"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "blockscale learn-scales: error: --fsdp-cpu-offload keeps the FSDP shards in CPU memory and computes on the "
        "GPU: it needs --device cuda (on a CPU run the shards are in CPU memory already; drop the flag)"]
    assert not (tmp_path / "o").exists()


def _saved_bytes(model, ids) -> tuple[int, dict]:
    """(bytes autograd saved for backward in one forward, the gradients of one backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).logits.float().pow(2).mean()
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_keeps_the_gradients_and_saves_less():
    """``checkpoint_blocks``: the LSQ student's gradients are bit for bit those without it, and the tensors
    autograd keeps for backward over one forward shrink to the blocks' inputs (at least 3x less here)."""
    import copy

    from blockscale import lsq
    from blockscale.ptq import PTQConfig, quantize_model
    from blockscale.train.fsdp import checkpoint_blocks

    model = tiny_hf_llama()
    quantize_model(model, PTQConfig(method="rtn"), None, progress=False)
    lsq.enable(model, mode="dual", param="log", train_weights=True)
    other = copy.deepcopy(model)
    assert checkpoint_blocks(other) == 2
    ids = token_ids(2, 32)
    plain_bytes, plain_grads = _saved_bytes(model, ids)
    ckpt_bytes, ckpt_grads = _saved_bytes(other, ids)
    assert sorted(plain_grads) == sorted(ckpt_grads) and plain_grads
    for n, g in plain_grads.items():
        assert torch.equal(g, ckpt_grads[n]), n
    assert ckpt_bytes * 3 < plain_bytes, (ckpt_bytes, plain_bytes)
