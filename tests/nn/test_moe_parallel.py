"""Expert-parallel MoE (blockscale.nn.moe_parallel) under a real 2-process torchrun (gloo), compared with
the single-process layer on the ranks' batches concatenated, and its single-process behaviour.

Run as a script, this file is the torchrun worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale.nn.moe import MoE, MoEConfig
from blockscale.nn.moe_parallel import CommConfig, ExpertParallelMoE, expert_parameter_names, to_expert_parallel
from blockscale.quant.transforms.wire import emulate, row_bytes

if __name__ != "__main__":  # the workers run on one thread; so must the reference (same GEMM reductions)
    pytestmark = pytest.mark.usefixtures("one_thread")

D, D_FF, E = 64, 96, 4
SIZES = {"uneven": (7, 12), "empty_rank": (0, 9)}  # tokens per rank
COMMS = {
    "bf16": CommConfig(),
    "nvfp4-s2f6": CommConfig(dispatch="nvfp4", combine="s2f6", dispatch_grad="mxfp8", combine_grad="mxfp8", seed=3),
    "nvfp4-mxfp8": CommConfig(dispatch="nvfp4", combine="mxfp8", combine_grad="mxfp8"),
}
CASES = [(s, c, shared) for s in SIZES for c in COMMS for shared in (False, True)]


def make_moe(shared: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, D_FF, MoEConfig(n_experts=E, top_k=2, shared_expert=shared))
    u = torch.nn.functional.normalize(torch.ones(D), dim=0)
    with torch.no_grad():  # expert 3 (on rank 1) never wins: its logit is about -40 for these inputs
        moe.router.weight[3] = -10.0 * u
    return moe


def inputs(sizes):
    g = torch.Generator().manual_seed(1)
    n = sum(sizes)
    u = torch.nn.functional.normalize(torch.ones(D), dim=0)
    x = torch.randn(n, D, generator=g) + 4.0 * u
    x[0, 5] = 40.0 if n else 0.0  # an outlier feature
    grad = torch.randn(n, D, generator=g)
    return x, grad


def run_layer(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out = layer(x.view(1, -1, D)).view(-1, D)
    (out * grad).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _worker(out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    results = {}
    for size, comm, shared in CASES:
        sizes = SIZES[size]
        x, grad = inputs(sizes)
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
        layer = ExpertParallelMoE(make_moe(shared), COMMS[comm])
        out, dx, grads = run_layer(layer, x[lo:hi], grad[lo:hi])
        for n in list(grads):
            if n.startswith("router") or n.startswith("shared_expert"):  # replicated: sum over ranks
                torch.distributed.all_reduce(grads[n])
        results[(size, comm, shared)] = {"out": out, "dx": dx, "grads": grads, "bytes": dict(layer.stats.bytes),
                                         "rows": dict(layer.stats.rows)}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    out = tmp_path_factory.mktemp("ep")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stderr[-8000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("size,comm,shared", CASES)
def test_expert_parallel_equals_single_process(torchrun_results, size, comm, shared):
    """Forward: bit for bit the single-process layer with the same payloads emulated (rows reach each
    expert in the same order); expert gradients too (without a shared expert, whose GEMM sees other
    row counts); input / replicated gradients to FP32 rounding."""
    sizes = SIZES[size]
    x, grad = inputs(sizes)
    ref = ExpertParallelMoE(make_moe(shared), COMMS[comm])  # no process group: one rank, emulated payloads
    out, dx, grads = run_layer(ref, x, grad)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    got_out = torch.cat([r[(size, comm, shared)]["out"] for r in torchrun_results])
    got_dx = torch.cat([r[(size, comm, shared)]["dx"] for r in torchrun_results])
    if shared:
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got_out, out)
    torch.testing.assert_close(got_dx, dx, rtol=1e-4, atol=1e-5)
    for rank, res in enumerate(torchrun_results):
        g = res[(size, comm, shared)]["grads"]
        assert {"experts.w1", "experts.w2", "experts.w3", "router.weight"} <= set(g)
        for name in ("w1", "w2", "w3"):
            want = grads[f"experts.{name}"][2 * rank:2 * rank + 2]
            if shared:
                torch.testing.assert_close(g[f"experts.{name}"], want, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(g[f"experts.{name}"], want), (rank, name)
        torch.testing.assert_close(g["router.weight"], grads["router.weight"], rtol=1e-4, atol=1e-6)
    # expert 3 got no tokens: finite, zero gradient
    assert torch.equal(grads["experts.w1"][3], torch.zeros(D_FF, D))


def test_quantized_payloads_change_the_result(torchrun_results):
    """The wire formats are really applied: quantized payloads differ from bf16 ones."""
    a = torch.cat([r[("uneven", "bf16", False)]["out"] for r in torchrun_results])
    b = torch.cat([r[("uneven", "nvfp4-s2f6", False)]["out"] for r in torchrun_results])
    rel = float((a - b).pow(2).sum() / a.pow(2).sum())
    assert 1e-5 < rel < 0.05, rel


@pytest.mark.parametrize("comm", list(COMMS))
def test_wire_statistics_count_rows_sent_to_the_other_rank(torchrun_results, comm):
    c = COMMS[comm]
    for rank, res in enumerate(torchrun_results):
        st = res[("uneven", comm, False)]
        for key, payload in (("dispatch", c.dispatch), ("combine", c.combine), ("dispatch_grad", c.dispatch_grad),
                             ("combine_grad", c.combine_grad)):
            assert st["bytes"][key] == st["rows"][key] * row_bytes(payload, D)
        assert st["rows"]["dispatch"] > 0
        # each rank sends back (combine) what the other sent it (dispatch)
        other = torchrun_results[1 - rank][("uneven", comm, False)]
        assert st["rows"]["combine"] == other["rows"]["dispatch"]
        assert st["rows"]["combine_grad"] == st["rows"]["dispatch"]


def test_single_process_layer_equals_moe_with_emulated_payloads():
    """Without a process group the layer is the MoE with its dispatched rows and expert outputs passed
    through the wire formats' emulation."""
    from blockscale.nn.moe import combine, dispatch

    moe = make_moe(False)
    x, _ = inputs((10,))
    comm = COMMS["nvfp4-s2f6"]
    layer = ExpertParallelMoE(moe, comm)
    with torch.no_grad():
        plan, _ = moe.router(x)
        y = moe.experts(emulate(dispatch(x, plan), comm.dispatch), plan.counts)
        want = combine(emulate(y, comm.combine, seed=comm.seed), plan, x.shape[0])
        assert torch.equal(layer(x.view(1, 10, D)).view(10, D), want)
        plain = ExpertParallelMoE(moe, CommConfig())
        assert not torch.equal(plain(x.view(1, 10, D)).view(10, D), want)


def test_to_expert_parallel_and_bad_config():
    from blockscale.models.llama import Llama, LlamaConfig

    m = Llama(LlamaConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=16,
                          moe=MoEConfig(n_experts=4, top_k=2)), seed=0)
    names = to_expert_parallel(m, CommConfig(dispatch="nvfp4"))
    assert len(names) == 2 and all(isinstance(m.get_submodule(n), ExpertParallelMoE) for n in names)
    assert f"{names[0]}.experts.w1" in expert_parameter_names(m)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    m.train()
    logits, loss = m(x, y)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 32), y.view(-1))
    aux = sum(m.get_submodule(n).aux_loss for n in names)
    assert float(aux.detach()) > 0 and torch.equal(loss, ce + aux)  # the load-balancing loss reaches the training loss
    import copy

    clone = copy.deepcopy(m)  # after a training forward: aux_loss (tied to its graph) is not copied
    assert all(clone.get_submodule(n).aux_loss is None for n in names)
    for bad, match in ((dict(dispatch="mxfp8"), "CommConfig.dispatch"), (dict(combine="nvfp4"), "CommConfig.combine"),
                       (dict(dispatch_grad="s2f6"), "CommConfig.dispatch_grad"), (dict(seed=1.5), "seed")):
        with pytest.raises(ValueError, match=match):
            CommConfig(**bad)
    with pytest.raises(ValueError, match="MoE"):
        ExpertParallelMoE(torch.nn.Linear(4, 4))


if __name__ == "__main__":
    _worker(sys.argv[1])
    from blockscale.train.distributed import exit_process

    exit_process(0)  # a rank ends without interpreter finalisation (see exit_process)
