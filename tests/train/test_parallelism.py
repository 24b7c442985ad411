"""Which ``train.parallelism`` strategy a ``LoopConfig`` picks, and the combinations refused before the
model is touched (the strategies themselves run in test_train.py, test_fsdp.py and
test_train_expert_parallel.py, under torchrun too)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockscale.errors import UsageError
from blockscale.nn.moe_parallel import CommConfig
from blockscale.train import CheckpointContents, DistInfo, LoopConfig
from blockscale.train.parallelism import (DataParallelism, ExpertParallelism, FullyShardedParallelism,
                                          RunCheckpoint, select_parallelism)

EP_REFUSAL = ("expert parallelism runs with DDP and whole-model checkpoints: it cannot be combined with FSDP or a "
              "frozen-base task")


@pytest.mark.parametrize("options, strategy", [
    ({}, DataParallelism),
    ({"fsdp": True}, FullyShardedParallelism),
    ({"expert_parallel": CommConfig()}, ExpertParallelism),
])
def test_the_config_picks_one_strategy(options, strategy):
    for info in (DistInfo(), DistInfo(rank=1, world_size=2)):
        picked = select_parallelism(LoopConfig(steps=1, **options), info, CheckpointContents())
        assert type(picked) is strategy and picked.info == info


def test_one_process_is_data_parallel_without_a_wrapper():
    model = torch.nn.Linear(2, 2)
    setup = select_parallelism(LoopConfig(steps=1), DistInfo(), CheckpointContents()).prepare(
        model, _HeadTask(), list(model.parameters()), None, torch.device("cpu"), _no_files(), False, False)
    assert setup.train_model is model and setup.state is None and setup.note is None


@pytest.mark.parametrize("options, contents", [
    ({"fsdp": True}, CheckpointContents()),
    ({}, CheckpointContents(trainable_only=True)),
])
def test_expert_parallelism_refuses_fsdp_and_frozen_base_tasks(options, contents):
    loop = LoopConfig(steps=1, expert_parallel=CommConfig(), **options)
    with pytest.raises(UsageError) as exc:
        select_parallelism(loop, DistInfo(), contents)
    assert str(exc.value) == EP_REFUSAL


def test_expert_parallel_must_be_a_comm_config():
    with pytest.raises(UsageError, match=r"^expert_parallel must be a blockscale.nn.moe_parallel.CommConfig, got str$"):
        select_parallelism(LoopConfig(steps=1, expert_parallel="bf16"), DistInfo(), CheckpointContents())


def test_fsdp_in_one_process_is_refused_when_prepared():
    strategy = select_parallelism(LoopConfig(steps=1, fsdp=True), DistInfo(), CheckpointContents())
    assert strategy.shown_path(Path("run/ckpt.pt")) == Path("run/ckpt.dcp") and strategy.shown_path(None) is None
    with pytest.raises(UsageError, match=r"^--fsdp needs a torchrun job with at least 2 processes"):
        strategy.prepare(torch.nn.Linear(2, 2), _HeadTask(), [], LoopConfig(steps=1, fsdp=True),
                         torch.device("cpu"), _no_files(), False, False)


class _HeadTask:
    contents = CheckpointContents()
    config: dict = {}

    def make_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)


def _no_files():
    return RunCheckpoint(None, CheckpointContents(), {})
