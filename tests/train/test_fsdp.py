"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for ``train`` and ``learn-scales`` (blockscale.train.fsdp),
on CPU with 2 gloo processes (``torch.multiprocessing`` spawn).

Every piece of FSDP2 the workflows use runs on CPU / gloo in torch 2.13: fully_shard with uneven shards,
forward / backward / optimizer step, MixedPrecisionPolicy (bf16 parameters, fp32 reduction), DCP save and
load, full state dicts; so nothing here is skipped. One spawn (the module fixture ``runs``) runs every
distributed scenario and saves what rank 0 saw; the tests compare it with single-process runs.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import socket
import sys

import pytest
import torch

from blockscale import lsq
from blockscale.errors import UsageError
from blockscale.lsq.distill import DistillConfig, distill, load_distill_checkpoint
from blockscale.ptq import PTQConfig, quantize_model
from blockscale.train import TokenData, TrainConfig, load_training_checkpoint, read_metrics, train

pytest.importorskip("transformers")
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

TRAIN_CFG = dict(steps=3, batch_size=2, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=1, eval_batches=1,
                 eval_interval=0, ckpt_interval=2, log_interval=1, grad_clip=100.0, progress=False, plot=False, device="cpu",
                 autocast="none", seed=3)
DISTILL_CFG = dict(train="all", steps=3, lr_scales=1e-3, lr_weights=1e-4, batch_size=2, grad_accum=2, seq_len=24,
                   log_every=1, eval_every=2, seed=5)


class Interrupted(RuntimeError):
    pass


def synthetic_data(stop_at=None) -> TokenData:
    """A seeded stream over 64 symbols; ``stop_at``: get_batch raises Interrupted at that 0-based train step
    (on every rank, before any collective of the step: a clean kill after the previous checkpoint)."""
    g = torch.Generator().manual_seed(0)
    data = TokenData.from_tokens(torch.randint(0, 64, (6000,), generator=g), vocab_size=64)
    if stop_at is not None:
        get = data.get_batch

        def get_batch(split, *a, **kw):
            step = kw.get("step", a[2] if len(a) > 2 else None)
            if split == "train" and step == stop_at:
                raise Interrupted(f"stopped at step {stop_at}")
            return get(split, *a, **kw)
        data.get_batch = get_batch
    return data


def tiny_llama_lm(recipe: bool = True):
    """The blockscale Llama "tiny" preset (dim 32, 2 blocks) on the 64-symbol data, NVFP4-trained
    (``nvfp4-nvidia``: 16x16 weight blocks, per-tensor outer scales, stochastic rounding, RHT) if ``recipe``."""
    from blockscale.cli.common import resolve_recipe
    from blockscale.cli.train import build_model
    from blockscale.nn import convert

    model = build_model("tiny", 64, 16, seed=0)
    if recipe:
        convert(model, resolve_recipe("nvfp4-nvidia"))
    return model


def lsq_pair():
    """(teacher, LSQ student): a W4A4 dual-mode LSQ model of a tiny HF Llama (its input scales fixed at
    calibration, so a rank's batch does not change another rank's quantization)."""
    teacher = tiny_hf_llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(activations="w4a4"), calibration=token_ids(8, 32, seed=7), progress=False)
    lsq.enable(student, mode="dual", weights=teacher)
    return teacher, student


def _trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _sharded_linear_check(out):
    """A QuantizedLinear (NVFP4, 16x16 weight blocks, per-tensor outer scale) sharded over 2 ranks (24
    rows each: not even a whole 16-row block) vs the same layer unsharded: output and gradients."""
    from blockscale.cli.common import resolve_recipe
    from blockscale.nn.linear import QuantizedLinear
    from blockscale.train.fsdp import clip_sharded, shard_model

    torch.manual_seed(0)
    recipe = dataclasses.replace(resolve_recipe("nvfp4-nvidia").linear, wgrad_hadamard=0)
    ref = QuantizedLinear(32, 48, recipe=recipe)
    with torch.no_grad():
        ref.weight[40:] *= 30  # the full weight's amax lives on rank 1's rows only
    sharded = copy.deepcopy(ref)
    shard_model(sharded)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    out["linear_local_rows"] = sharded.weight.to_local().shape[0]
    y_ref, y = ref(x), sharded(x)
    torch.manual_seed(5)  # the same stochastic-rounding draws in both backwards
    y_ref.square().sum().backward()
    torch.manual_seed(5)
    y.square().sum().backward()
    out["linear_y"] = (y_ref.detach(), y.detach())
    out["linear_dw"] = (ref.weight.grad.clone(), sharded.weight.grad.full_tensor())
    params = [sharded.weight, sharded.bias]
    out["clip"] = (torch.nn.utils.clip_grad_norm_([ref.weight, ref.bias], 0.5), clip_sharded(params, 0.5),
                   ref.weight.grad, sharded.weight.grad.full_tensor())


def _worker(rank: int, port: int, out_dir: str, group: str):
    import os
    from pathlib import Path

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    base, out = Path(out_dir), {}
    try:
        (_train_runs if group == "train" else _lsq_runs)(base, out)
        if rank == 0:
            torch.save(out, base / "rank0.pt")
    finally:
        dist.destroy_process_group()
    from blockscale.train.distributed import exit_process

    exit_process(0)  # after success only: a rank ends without interpreter finalisation (see exit_process)


def _train_runs(base, out):
    """train: a sharded QuantizedLinear, DDP, FSDP (fp32), FSDP interrupted after its step-2 checkpoint
    then resumed, FSDP bf16."""
    _sharded_linear_check(out)
    cfg = dict(TRAIN_CFG)
    out["ddp"] = train(tiny_llama_lm(), synthetic_data(), TrainConfig(out_dir=str(base / "ddp"), **cfg)).train_losses
    m = tiny_llama_lm()
    out["fsdp"] = train(m, synthetic_data(), TrainConfig(out_dir=str(base / "fsdp"), fsdp=True, **cfg)).train_losses
    out["fsdp_plain_after"] = all(type(p) is torch.nn.Parameter for p in m.parameters())
    try:
        train(tiny_llama_lm(), synthetic_data(stop_at=2), TrainConfig(out_dir=str(base / "resume"), fsdp=True, **cfg))
    except Interrupted:
        out["interrupted"] = sorted(p.name for p in (base / "resume").iterdir())
    res = train(tiny_llama_lm(), synthetic_data(), TrainConfig(out_dir=str(base / "resume"), fsdp=True, **cfg),
                resume=True)
    out["resumed"], out["resumed_start"] = res.train_losses, res.start_step
    out["bf16"] = train(tiny_llama_lm(), synthetic_data(), TrainConfig(
        out_dir=None, fsdp=True, fsdp_param_dtype="bf16", **{**cfg, "ckpt_interval": 0})).train_losses
    plain = tiny_llama_lm(recipe=False)  # no recipe: 2 ranks x batch 2 must equal one process x batch 4
    out["fsdp_plain"] = train(plain, synthetic_data(), TrainConfig(
        out_dir=None, fsdp=True, **{**cfg, "ckpt_interval": 0})).train_losses
    out["fsdp_plain_params"] = {n: p.detach().clone() for n, p in plain.named_parameters()}


def _lsq_runs(base, out):
    """learn-scales: FSDP fp32 (student and teacher sharded), interrupted + resumed, bf16."""
    tokens, ev = token_ids(16, 32, seed=6), token_ids(4, 24, seed=9)
    teacher, student = lsq_pair()
    distill(student, teacher, tokens, DistillConfig(out_dir=str(base / "lsq"), fsdp=True, **DISTILL_CFG),
            eval_tokens=ev, progress=False)
    out["lsq_trainable"] = _trainable(student)
    out["lsq_teacher_plain"] = all(type(p) is torch.nn.Parameter for p in teacher.parameters())
    distill_mod = sys.modules["blockscale.lsq.distill"]
    batch = distill_mod._batch

    def interrupted_batch(tokens_, cfg_, step, micro, info):
        if step == 2:
            raise Interrupted("stopped at step 2")
        return batch(tokens_, cfg_, step, micro, info)
    teacher, student = lsq_pair()
    distill_mod._batch = interrupted_batch
    try:
        distill(student, teacher, tokens, DistillConfig(out_dir=str(base / "lsq_resume"), fsdp=True, **DISTILL_CFG),
                eval_tokens=ev, progress=False)
    except Interrupted:
        pass
    finally:
        distill_mod._batch = batch
    teacher, student = lsq_pair()
    distill(student, teacher, tokens, DistillConfig(out_dir=str(base / "lsq_resume"), fsdp=True, **DISTILL_CFG),
            eval_tokens=ev, resume=True, progress=False)
    out["lsq_resumed_trainable"] = _trainable(student)
    teacher, student = lsq_pair()
    seen = {}

    def record(name, *tensors):
        def hook(module, args):
            seen.setdefault(name, [t(module).dtype for t in tensors])
        return hook
    learner = lsq.learner_modules(student)[0]
    hooks = [teacher.model.layers[0].mlp.down_proj.register_forward_pre_hook(record("teacher", lambda m: m.weight)),
             student.model.layers[0].input_layernorm.register_forward_pre_hook(record("norm", lambda m: m.weight)),
             learner.register_forward_pre_hook(record("learner", lambda m: m.weight, lambda m: m.amax_pre))]
    r = distill(student, teacher, tokens, DistillConfig(fsdp=True, fsdp_param_dtype="bf16",
                                                        **{**DISTILL_CFG, "eval_every": 0}), progress=False)
    for h in hooks:
        h.remove()
    out["lsq_bf16"] = (r["first_loss"], r["final_loss"], {p.dtype for p in lsq.scale_parameters(student)}, seen)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path_factory, group: str):
    import torch.multiprocessing as mp

    base = tmp_path_factory.mktemp(f"fsdp_{group}")
    mp.spawn(_worker, args=(_free_port(), str(base), group), nprocs=2, join=True)
    return base, torch.load(base / "rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process train scenarios, once: (run directory, what rank 0 saved)."""
    return _spawn(tmp_path_factory, "train")


@pytest.fixture(scope="module")
def lsq_runs(tmp_path_factory):
    """The 2-process learn-scales scenarios, once."""
    return _spawn(tmp_path_factory, "lsq")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (conftest's one_thread)."""


def test_sharded_quantized_linear_quantizes_the_full_weight(runs):
    """The forward all-gathers the weight: the NVFP4 outer scale is the full tensor's amax (rank 1 holds
    the outliers) and 16x16 blocks cross no shard edge: output and weight gradient equal the unsharded
    layer's bit for bit."""
    _, out = runs
    assert out["linear_local_rows"] == 24
    y_ref, y = out["linear_y"]
    assert torch.equal(y, y_ref)
    dw_ref, dw = out["linear_dw"]
    assert torch.equal(dw, dw_ref)
    # clip_sharded == torch's clip_grad_norm_ up to the norm's summation order (shards' squares summed)
    norm_ref, norm, g_ref, g = out["clip"]
    assert float(norm_ref) > 0.5 and float(norm) == pytest.approx(float(norm_ref), rel=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=0)


def test_train_nvfp4_fsdp_matches_ddp(runs):
    """2 ranks, nvfp4-nvidia recipe (stochastic rounding from the per-rank reseeded RNG, as under DDP):
    FSDP2 (fp32 policy) == DDP on the same per-rank batches, bit for bit: the gradient average is the same
    sum of two halves (divisions by 2 are exact). The clip bound is not reached here (grad_clip 100): the
    clipping norm sums the shards' squares, not torch's norm of per-tensor norms, so an active clip moves
    the last bits, and a 1-ulp weight change can flip an NVFP4 rounding (measured: 1.4e-3 in one weight
    after 3 steps with grad_clip 1). (A single process is not the reference here: NVFP4 activations take
    their per-tensor scale from each rank's batch, so 1 x batch 4 != 2 x batch 2 under DDP too.) The
    final ckpt.pt, gathered on rank 0, equals DDP's."""
    base, out = runs
    assert len(out["fsdp"]) == 3
    assert out["fsdp"] == out["ddp"]
    ddp, fsdp = load_training_checkpoint(base / "ddp" / "ckpt.pt"), load_training_checkpoint(base / "fsdp" / "ckpt.pt")
    assert fsdp["step"] == 3 and fsdp["world_size"] == 2 and set(fsdp["model"]) == set(ddp["model"])
    for k, v in ddp["model"].items():
        assert torch.equal(fsdp["model"][k], v), k
    assert fsdp["optimizer"]["param_groups"][0]["params"] == ddp["optimizer"]["param_groups"][0]["params"]
    assert sorted(fsdp["optimizer"]["state"]) == sorted(ddp["optimizer"]["state"])
    assert [r["step"] for r in read_metrics(base / "fsdp" / "metrics.jsonl")] == [1, 2, 3]
    assert out["fsdp_plain_after"]  # the caller's model is plain again (no DTensors)


def test_train_fsdp_resume_is_exact(runs):
    """Killed after the step-2 sharded checkpoint (ckpt.dcp, complete; no ckpt.pt yet), resumed with
    --fsdp: step 3 repeats the uninterrupted run bit for bit (gloo on CPU), and the final
    checkpoints are identical."""
    base, out = runs
    assert out["interrupted"] == ["ckpt.dcp", "config.json", "metrics.jsonl"]
    assert out["resumed_start"] == 2
    assert out["resumed"] == out["fsdp"][2:]
    a, b = load_training_checkpoint(base / "fsdp" / "ckpt.pt"), load_training_checkpoint(base / "resume" / "ckpt.pt")
    for k, v in a["model"].items():
        assert torch.equal(b["model"][k], v), k
    assert [r["train_loss"] for r in read_metrics(base / "resume" / "metrics.jsonl")] == out["fsdp"]


def test_train_fsdp_bf16_policy(runs):
    """bf16 parameters in forward / backward (fp32 reduction and masters): not the fp32 run's bits, but
    the same run within 2% per step on this tiny model (bf16 has 8 mantissa bits)."""
    _, out = runs
    assert out["bf16"] != out["fsdp"]
    assert out["bf16"] == pytest.approx(out["fsdp"], rel=2e-2)


def test_train_fsdp_matches_single_process_on_the_combined_batch(runs):
    """Without a recipe (FP32 GEMMs): FSDP2 over 2 ranks x batch 2 == one process x batch 4 (the same rows,
    train's sampler): losses to 1e-6; parameters to atol 1e-5 (an Adam step at lr 1e-2 moves an element by
    up to 1e-2; the reduce-scatter sums the two ranks' gradients in another order than one backward, and
    Adam's g / sqrt(v) turns that rounding of a near-zero gradient into up to 3e-6, measured)."""
    _, out = runs
    single = tiny_llama_lm(recipe=False)
    res = train(single, synthetic_data(), TrainConfig(out_dir=None, **{**TRAIN_CFG, "batch_size": 4,
                                                                        "ckpt_interval": 0}))
    assert out["fsdp_plain"] == pytest.approx(res.train_losses, rel=1e-6)
    ref = dict(single.named_parameters())
    assert set(out["fsdp_plain_params"]) == set(ref)
    for k, v in out["fsdp_plain_params"].items():
        torch.testing.assert_close(v, ref[k].detach(), rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_learn_scales_fsdp_matches_single_process(lsq_runs):
    """learn-scales (train="all", W4A4 dual, grad_accum 2): FSDP2 over 2 ranks x batch 2 == one process x
    batch 4 (the same rows: a stateless sampler). Tolerances: losses rel 1e-5 and amaxes / latent weights
    rtol 1e-5 (the ranks' gradients are averaged: another summation order than one batch of 4)."""
    base, out = lsq_runs
    teacher, single = lsq_pair()
    res = distill(single, teacher, token_ids(16, 32, seed=6), DistillConfig(
        **{**DISTILL_CFG, "batch_size": 4}, out_dir=str(base / "lsq_single")), eval_tokens=token_ids(4, 24, seed=9),
        progress=False)
    ref, got = _trainable(single), out["lsq_trainable"]
    assert set(got) == set(ref) and any(n.endswith("amax_pre") for n in ref)
    for n, v in ref.items():
        torch.testing.assert_close(got[n], v, rtol=1e-5, atol=1e-6, msg=n)
    rows, one = read_metrics(base / "lsq" / "metrics.jsonl"), read_metrics(res["metrics_path"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert rows[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    ck = load_distill_checkpoint(base / "lsq" / "latest.pt")  # gathered on rank 0, as without --fsdp
    assert ck["step"] == 3 and ck["world_size"] == 2 and set(ck["trainable"]) == set(ref)
    for n, v in ck["trainable"].items():
        assert torch.equal(v, got[n]), n
    assert out["lsq_teacher_plain"]


def test_learn_scales_fsdp_resume_is_exact(lsq_runs):
    """Interrupted in step 3 (after the step-2 latest.dcp), resumed: the learned amaxes and latent weights
    equal the uninterrupted run's bit for bit."""
    _, out = lsq_runs
    for n, v in out["lsq_trainable"].items():
        assert torch.equal(out["lsq_resumed_trainable"][n], v), n


def test_learn_scales_fsdp_bf16_keeps_learners_fp32(lsq_runs):
    """fsdp_param_dtype bf16: in forward the teacher's and the student's other parameters are all-gathered
    in bf16, the learners (FP32 units of their own) keep latent weight and amaxes in FP32, and the
    learned amaxes are FP32 parameters after the run; the losses are finite."""
    _, out = lsq_runs
    first, final, dtypes, seen = out["lsq_bf16"]
    assert seen == {"teacher": [torch.bfloat16], "norm": [torch.bfloat16], "learner": [torch.float32, torch.float32]}
    assert dtypes == {torch.float32}
    assert all(math.isfinite(v) for v in (first, final))


def test_fsdp_needs_torchrun_and_checks_its_options(tmp_path, capsys):
    """Without torchrun --fsdp is refused in one line (no silent single-process fallback: nothing to
    shard over); a bad policy dtype names the field and the allowed values."""
    from blockscale.cli import main as cli_main
    from blockscale.cli.train import main as train_main

    text = tmp_path / "t.txt"
    text.write_text("abc " * 200)
    assert train_main(["--data", str(text), "--steps", "1", "--fsdp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["blockscale train: error: --fsdp needs a torchrun job with at least 2 processes (torchrun "
                   "--nproc_per_node 2 -m blockscale.train ...); without torchrun drop --fsdp"]
    assert train_main(["--data", str(text), "--fsdp-param-dtype", "fp16"]) == 2
    assert capsys.readouterr().err.strip() == "blockscale train: error: --fsdp-param-dtype fp16: expected 'fp32' or 'bf16'"
    code = cli_main(["learn-scales", "stories260k", "--out", str(tmp_path / "o"), "--fsdp"])
    assert code == 2 and "--fsdp needs a torchrun job" in capsys.readouterr().err
    with pytest.raises(UsageError, match="fsdp_param_dtype='fp16'; allowed values: 'fp32', 'bf16'"):
        DistillConfig(fsdp=True, fsdp_param_dtype="fp16")
    with pytest.raises(ValueError, match="TrainConfig.fsdp_param_dtype='fp16': expected 'fp32' or 'bf16'"):
        TrainConfig(fsdp=True, fsdp_param_dtype="fp16")
    with pytest.raises(UsageError, match="needs a torchrun job"):
        train(tiny_llama_lm(recipe=False), synthetic_data(), TrainConfig(fsdp=True, **{**TRAIN_CFG, "steps": 1}))
