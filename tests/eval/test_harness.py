"""lm-evaluation-harness on a model in memory (``bs.eval.evaluate_tasks``): offline tasks from a local YAML and
JSONL data, the reported accuracies checked against a hand count (``local_tasks.hand_count``)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import blockscale as bs
from blockscale.eval.harness import TaskResults, parse_results, task_manager
from local_tasks import LL_TASK, MC_TASK, hand_count, write_tasks

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")


def _assert_counted(res, expected, items):
    for task, metrics in expected.items():
        assert set(metrics) <= set(res.metrics[task]), res.metrics
        for metric, value in metrics.items():
            assert res.metrics[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)  # (FP32 sums there)
        assert res.items[task] == items[task]


def test_local_tasks_match_a_hand_count(tmp_path, stories260k):
    folder = write_tasks(tmp_path / "tasks")
    model, tok = stories260k.model, stories260k.tokenizer.hf
    random.seed(7)
    torch.manual_seed(0)
    before = (random.random(), float(torch.rand(1)))
    random.seed(7)
    torch.manual_seed(0)
    res = bs.eval.evaluate_tasks(model, tok, [MC_TASK, LL_TASK], include_path=str(folder), batch_size=3)
    assert (random.random(), float(torch.rand(1))) == before  # lm-eval's seeding leaves the caller's generators alone
    expected = hand_count(model, tok)
    assert expected[MC_TASK]["acc"] != expected[MC_TASK]["acc_norm"]  # (the documents tell the two apart)
    _assert_counted(res, expected, {MC_TASK: 10, LL_TASK: 6})
    assert res.higher_is_better[LL_TASK] == {"acc": True, "perplexity": False}
    # --limit: the first documents
    few = bs.eval.evaluate_tasks(model, tok, [MC_TASK, LL_TASK], include_path=str(folder), limit=4)
    _assert_counted(few, hand_count(model, tok, limit=4), {MC_TASK: 4, LL_TASK: 4})


def test_task_manager_indexes_lm_eval_tasks_only_when_needed(tmp_path):
    folder = write_tasks(tmp_path / "tasks")
    assert task_manager([MC_TASK], str(folder)).all_tasks == sorted([MC_TASK, LL_TASK])
    with pytest.raises(ValueError, match=f"unknown task\\(s\\) no_such_task: not found in {folder} or among"):
        task_manager([MC_TASK, "no_such_task"], str(folder))


def test_recovery_and_results():
    raw = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "perplexity,none": 8.0,
                             "exact_match,strict-match": 0.25}, "g": {"acc,none": 0.4}},
           "groups": {"g": {"acc,none": 0.4}}, "n-samples": {"t": {"original": 10, "effective": 8}},
           "higher_is_better": {"t": {"acc": True, "perplexity": False, "exact_match": True}}}
    res = parse_results(raw)
    assert res.metrics == {"t": {"acc": 0.5, "perplexity": 8.0, "exact_match,strict-match": 0.25}}
    assert res.items == {"t": 8} and res.groups == {"g": {"acc": 0.4}}
    base = TaskResults({"t": {"acc": 0.625, "perplexity": 4.0, "exact_match,strict-match": 0.0}},
                       {"t": {"acc": True, "perplexity": False}})
    rec = bs.eval.task_recovery(res, base)["t"]
    assert rec["acc"] == 0.8 and rec["perplexity"] == 0.5 and math.isnan(rec["exact_match,strict-match"])


def test_vllm_model_args():
    assert bs.eval.vllm_model_args("ckpt/") == {"pretrained": "ckpt/", "tokenizer": "ckpt/", "dtype": "auto",
                                                "trust_remote_code": False}
    args = bs.eval.vllm_model_args("org/model", dtype="bfloat16", max_length=2048,
                                   extra={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8})
    assert args == {"pretrained": "org/model", "tokenizer": "org/model", "dtype": "bfloat16",
                    "trust_remote_code": False, "max_model_len": 2048, "tensor_parallel_size": 2,
                    "gpu_memory_utilization": 0.8}
