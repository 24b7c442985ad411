"""Data-parallel PTQ calibration (``blockscale.ptq.distributed``) under a real 2-process torchrun (gloo, CPU),
compared with one process on the same calibration ids.

Exact (bit for bit): RTN W4A4, the FP8 static recipe, AWQ, SmoothQuant, the mixed MoE recipe with an FP8 KV cache,
and RTN on fused MoE experts with its per-expert token counts: every rank runs exactly the single-process
calibration batches and the reductions of their statistics (sums of counts, maxima, AWQ's rows concatenated in
rank order) are exact. GPTQ: the Hessian is reduced as (sum_r n_r H_r) / N in float64 rather than one FP32
running mean over the batches, so it differs from one process by rounding (relative ~1e-6) and a few GPTQ
rounding decisions may flip: the weights are compared within a stated tolerance, and the ranks with each other
bit for bit. Also the ``quantize`` command under torchrun on stories260K: rank 0 alone writes, and the checkpoint
equals the single-process one (RTN W4A4) tensor for tensor.

Run as a script, this file is the torchrun worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
from blockscale.recipes import get_ptq_recipe

transformers = pytest.importorskip("transformers")
from tiny_models import checkpoint_tensors, tiny_hf_llama, token_ids  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# AWQ samples every 4th input row of each batch (ceil(8 x 16 / 40)): the rows of both ranks, in rank order, are the
# single-process sample
AWQ = AWQOptions(grid=5, max_tokens=40)
# case -> (model family, PTQConfig keywords, calibration rows): 2 rows per batch, so 2 ranks get 2 + 2 batches of
# 8 rows, 1 + 2 of 5 rows (uneven) and 0 + 1 of 2 rows (rank 0 without a batch)
CASES = {
    "rtn-w4a4": ("llama", dict(activations="w4a4"), 8),
    "fp8-static": ("llama", dict(recipe="fp8"), 5),
    "awq-w4a4": ("llama", dict(method="awq", activations="w4a4", options=AWQ), 8),
    "smoothquant-w4a4": ("llama", dict(method="smoothquant", activations="w4a4"), 5),
    "awq-one-batch": ("llama", dict(method="awq", options=AWQ), 2),
    "moe-rtn-w4a4": ("qwen3_moe", dict(activations="w4a4"), 8),
    "moe-mixed-kv": ("mixtral", dict(recipe="nvfp4-experts-fp8-attention"), 5),
    "gptq-w4a16": ("llama", dict(method="gptq"), 8),
    "moe-gptq": ("qwen3_moe", dict(method="gptq"), 8),
    # AWQ auto-clip (its solves spread over the ranks) and GPTQ true-sequential with rank 0 without a batch
    "awq-clip-w4a4": ("llama", dict(method="awq", activations="w4a4", options=AWQOptions(grid=5, max_tokens=40,
                                                                                          clip=True)), 8),
    "gptq-true-sequential-one-batch": ("llama", dict(method="gptq", options=GPTQOptions(true_sequential=True)), 2),
    # the rounded inputs' Hessians: the second pass reduced over the ranks, uneven batches
    "gptq-rounded-inputs-w4a4": ("llama", dict(method="gptq", activations="w4a4",
                                               options=GPTQOptions(rounded_inputs=True)), 5),
}
EXACT = [c for c in CASES if "gptq" not in c]


def build(case: str):
    """(model, config, calibration ids) of a case, the same in every process."""
    family, kw, rows = CASES[case]
    if family == "llama":
        model = tiny_hf_llama(seed=1)
    else:
        from tiny_moe import tiny_moe

        model = tiny_moe(family, seed=1)
    if "recipe" in kw:
        kw = {**kw, "recipe": get_ptq_recipe(kw["recipe"])}
    return model, PTQConfig(batch_size=2, **kw), token_ids(rows, 16, seed=3)


def run_case(case: str, **kw) -> dict:
    """Quantize a case; its state, report fields, the rows decoder layer 0 ran on (every pass over the
    calibration batches) and the statistics names GPTQ solved here."""
    from blockscale.ptq.capture import decoder_layers
    from blockscale.ptq.methods.gptq import GPTQ

    model, cfg, ids = build(case)
    rows, solved = [0], []
    hook = decoder_layers(model)[0].register_forward_pre_hook(
        lambda m, a, k: rows.__setitem__(0, rows[0] + (a[0] if a else k["hidden_states"]).shape[0]), with_kwargs=True)
    solve = GPTQ.quantize_weight

    def counted(self, weight, stats, spec, scale):
        solved.append(stats.name if stats is not None else None)
        return solve(self, weight, stats, spec, scale)

    GPTQ.quantize_weight = counted
    try:
        report = quantize_model(model, cfg, ids, progress=False, **kw)
    finally:
        GPTQ.quantize_weight = solve
        hook.remove()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "tokens": {lr.name: lr.tokens for lr in report.linears},
            "amax": {lr.name: lr.input_amax for lr in report.linears},
            "alpha": {lr.name: lr.smoothing_alpha for lr in report.linears},
            "experts": [(r.name, r.tokens, r.routed_tokens, r.input_amax) for r in report.experts],
            "out_rel": {lr.name: lr.output_rel_err for lr in report.linears},
            "expert_out_rel": [r.output_rel_err for r in report.experts],
            "kv": report.kv_cache, "calibration_tokens": report.calibration_tokens,
            "layer0_rows": rows[0], "solved": solved}


def _mismatch(rank: int) -> str:
    """Rank r is given other calibration ids than rank 0: what it raises."""
    try:
        quantize_model(tiny_hf_llama(), PTQConfig(activations="w4a4", batch_size=2), token_ids(4, 8, seed=rank),
                       progress=False)
        return "no error"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__} synced={getattr(exc, 'blockscale_synced', False)}: {exc}"


def _non_finite_share() -> str:
    """Token 95's embedding is inf and only the last calibration row holds it (rank 1's share): what is raised."""
    model = tiny_hf_llama()
    ids = token_ids(4, 8, seed=2, vocab=95)
    ids[3, 4] = 95
    with torch.no_grad():
        model.model.embed_tokens.weight[95] = float("inf")
    try:
        quantize_model(model, PTQConfig(activations="w4a4", batch_size=2), ids, progress=False)
        return "no error"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__} synced={getattr(exc, 'blockscale_synced', False)}: {exc}"


def _autoround_refused() -> str:
    """AutoRound under the 2-rank group: refused before any work, on every rank."""
    model, _, ids = build("rtn-w4a4")
    try:
        quantize_model(model, PTQConfig(method="autoround", batch_size=2), ids, progress=False)
        return "no error"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _worker(out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    res = {case: run_case(case) for case in CASES}
    res["mismatch"] = _mismatch(rank)
    res["non_finite"] = _non_finite_share()
    res["autoround"] = _autoround_refused()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests" / "support"),
                                           os.environ.get("PYTHONPATH", "")])}


def _torchrun(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"torchrun failed: {' '.join(cmd)}\n{proc.stderr[-8000:]}\n{proc.stdout[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    out = tmp_path_factory.mktemp("dp")
    _torchrun([str(Path(__file__).resolve()), str(out)], out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same GEMM blocking
    try:
        return {case: run_case(case) for case in CASES}
    finally:
        torch.set_num_threads(n)


def _same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1
                                                        else a[k], b[k].view(torch.uint8) if b[k].dtype.itemsize == 1
                                                        else b[k]), f"{what}: {k}"


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_same_quantized_model(ranks, case):
    _same_state(ranks[0][case]["state"], ranks[1][case]["state"], f"{case} rank 0 vs rank 1")
    for key in ("tokens", "amax", "alpha", "experts", "kv"):
        assert ranks[0][case][key] == ranks[1][case][key], (case, key)


@pytest.mark.parametrize("case", EXACT)
def test_two_processes_equal_one_bit_for_bit(ranks, single, case):
    got, ref = ranks[0][case], single[case]
    _same_state(got["state"], ref["state"], f"{case} 2 processes vs 1")
    for key in ("tokens", "amax", "alpha", "experts", "kv", "calibration_tokens"):
        assert got[key] == ref[key], (case, key)


def test_the_statistics_were_reduced(ranks, single):
    """Each rank saw only its share, yet reports the single-process token counts: 8 rows x 16 tokens."""
    got = ranks[1]["rtn-w4a4"]["tokens"]
    assert set(got.values()) == {8 * 16} and got == single["rtn-w4a4"]["tokens"]
    assert ranks[0]["awq-one-batch"]["tokens"] == single["awq-one-batch"]["tokens"]  # rank 0 had no batch


@pytest.mark.parametrize("case", ["moe-rtn-w4a4", "moe-mixed-kv", "moe-gptq"])
def test_moe_per_expert_token_counts_equal_one_process(ranks, single, case):
    got, ref = ranks[0][case]["experts"], single[case]["experts"]
    assert [g[0] for g in got] == [r[0] for r in ref] and len(got) == 2
    assert got[0][1] == ref[0][1] and got[0][2] == ref[0][2]  # layer 0: the routing of the unquantized model
    assert sum(got[0][2]) == 8 * 16 * 2 or case == "moe-mixed-kv"  # top-2 of every token
    if case != "moe-gptq":  # exact cases: every layer (GPTQ's layer 1 routes on slightly different weights)
        assert got == ref
    if case == "moe-mixed-kv":
        assert got[1][1] == ref[1][1] and ranks[0][case]["kv"] == single[case]["kv"] and ranks[0][case]["kv"]


# GPTQ: layer 0's Hessian differs from one process's by FP32 rounding only (relative ~1e-7), which may flip a
# few GPTQ rounding decisions in general (then later layers calibrate on slightly different inputs): at most 1%
# of the code / scale bytes of a tensor may differ, float tensors within 1e-5 relative, the reported output
# error tr(dW H dW^T) / tr(W H W^T) within 1e-4 relative. (On these models every code comes out identical.)
GPTQ_MAX_CHANGED = 0.01


@pytest.mark.parametrize("case", ["gptq-w4a16", "moe-gptq", "gptq-true-sequential-one-batch",
                                  "gptq-rounded-inputs-w4a4"])
def test_gptq_within_tolerance_of_one_process(ranks, single, case):
    got, ref = ranks[0][case], single[case]
    assert got["state"].keys() == ref["state"].keys()
    for key, want in ref["state"].items():
        have = got["state"][key]
        if have.is_floating_point() and have.dtype.itemsize > 1:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=0, msg=key)
        else:  # packed E2M1 codes, E4M3 block scales
            changed = float((have.view(torch.uint8) != want.view(torch.uint8)).float().mean())
            assert changed <= GPTQ_MAX_CHANGED, (key, changed)
    assert got["tokens"] == ref["tokens"] and got["out_rel"].keys() == ref["out_rel"].keys()
    for name, err in ref["out_rel"].items():
        assert got["out_rel"][name] == pytest.approx(err, rel=1e-4), name


@pytest.mark.parametrize("case", ["gptq-w4a16", "moe-gptq"])
def test_gptq_solves_are_spread_over_the_ranks(ranks, single, case):
    """Rank r solves the layer's j-th weight for j % 2 == r: together each weight once, none twice."""
    mine = [ranks[r][case]["solved"] for r in range(2)]
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    assert sorted(mine[0] + mine[1]) == sorted(single[case]["solved"])
    assert len(single[case]["solved"]) == len(set(single[case]["solved"])) > 10


def test_each_rank_runs_only_its_share(ranks, single):
    """The rows decoder layer 0 ran on: rank 0's plus rank 1's are the single-process ones (each pass over
    the calibration batches is split, not repeated)."""
    for case in CASES:
        got = [ranks[r][case]["layer0_rows"] for r in range(2)]
        assert got[0] + got[1] == single[case]["layer0_rows"], case
        assert got[1] > 0 and got[0] < single[case]["layer0_rows"], case


def test_calibration_must_be_the_same_on_every_rank(ranks):
    """Every rank is given the full calibration set and takes its share; ids that differ between ranks are
    refused on every rank, at the same point (so a command line reports it once)."""
    for r in range(2):
        assert ranks[r]["mismatch"].startswith("UsageError synced=True: calibration: rank 1 was given other "
                                                "calibration ids"), ranks[r]["mismatch"]


def test_data_parallel_argument():
    """data_parallel=True needs a process group; only None / True / False are accepted; False (or no process
    group) is the single-process run, bit for bit."""
    from blockscale.errors import UsageError

    model, cfg, ids = build("rtn-w4a4")
    with pytest.raises(UsageError, match="data_parallel=True needs an initialized torch.distributed process group"):
        quantize_model(model, cfg, ids, progress=False, data_parallel=True)
    with pytest.raises(UsageError, match="data_parallel='yes'; allowed values: None"):
        quantize_model(model, cfg, ids, progress=False, data_parallel="yes")
    ref = build("rtn-w4a4")[0]
    quantize_model(ref, cfg, ids, progress=False)
    quantize_model(model, cfg, ids, progress=False, data_parallel=False)
    _same_state(model.state_dict(), ref.state_dict(), "data_parallel=False")


def test_autoround_is_refused_data_parallel_on_every_rank(ranks):
    for r in range(2):
        assert ranks[r]["autoround"].startswith("UsageError: method='autoround' optimises each decoder layer on all "
                                                "calibration batches at once and does not run data-parallel yet: "
                                                "run it in one process"), ranks[r]["autoround"]


def test_an_error_of_one_rank_is_raised_on_every_rank(ranks):
    """Non-finite calibration inputs in rank 1's share only: rank 1 raises its DataError, rank 0 the same class
    naming rank 1, both at the same point (so neither waits on the other)."""
    got = [ranks[r]["non_finite"] for r in range(2)]
    assert got[1].startswith("DataError synced=True: model.layers.0.") and "NaN/inf" in got[1], got[1]
    assert got[0] == got[1].replace("synced=True: ", "synced=True: rank 1: ", 1), got


# ----------------------------------------------------------------------------- the quantize command

CLI = ["quantize", "stories260k", "--method", "gptq", "--w4a4", "--n-samples", "8", "--seq-len", "64",
       "--batch-size", "2"]


def test_quantize_command_under_torchrun_writes_one_checkpoint_equal_to_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m blockscale.cli quantize` (GPTQ, W4A4): rank 0 alone prints and writes; the
    checkpoint's tensors equal the single-process command's (codes and block scales: at most 1% of the bytes
    may differ, see GPTQ_MAX_CHANGED; the float tensors within 1e-5 relative; on stories260K all are equal)."""
    import json

    proc = _torchrun(["-m", "blockscale.cli", *CLI, "--out", str(tmp_path / "dp")], tmp_path)
    assert proc.stdout.count("wrote compressed-tensors checkpoint") == 1 and proc.stdout.count("loading ") == 1
    from blockscale import cli

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun workers (OMP_NUM_THREADS=1)
    try:
        assert cli.main([*CLI, "--out", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(n)
    got, ref = checkpoint_tensors(tmp_path / "dp"), checkpoint_tensors(tmp_path / "one")
    assert got.keys() == ref.keys() and len(got) > 20
    for key, want in ref.items():
        have = got[key]
        if have.is_floating_point() and have.dtype.itemsize > 1:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=0, msg=key)
        else:
            changed = float((have.view(torch.uint8) != want.view(torch.uint8)).float().mean())
            assert changed <= GPTQ_MAX_CHANGED, (key, changed)
    reports = [json.loads((tmp_path / d / "ptq_report.json").read_text())["ptq"] for d in ("dp", "one")]
    assert reports[0]["calibration_tokens"] == reports[1]["calibration_tokens"] == 8 * 64
    assert [lr["tokens"] for lr in reports[0]["linears"]] == [lr["tokens"] for lr in reports[1]["linears"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp", "one"]  # no half-written or per-rank directories


def test_quantize_command_under_torchrun_reports_an_error_once(tmp_path):
    """An error every rank meets (here --out: a directory that is not a checkpoint) is one line from rank 0,
    none from rank 1, no traceback of ours, a non-zero exit."""
    import re

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    proc = _torchrun(["-m", "blockscale.cli", *CLI, "--out", str(tmp_path / "taken")], tmp_path, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "blockscale quantize: error:" in line]
    assert len(lines) == 1 and "--out" in lines[0] and "rank 1" not in lines[0], proc.stderr[-3000:]
    assert not re.search(r'File ".*blockscale[/\\](ptq|cli|export)', proc.stderr)  # torchrun prints its own summary
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


if __name__ == "__main__":
    _worker(sys.argv[1])
    from blockscale.train.distributed import exit_process

    exit_process(0)  # a rank ends without interpreter finalisation (see exit_process)
