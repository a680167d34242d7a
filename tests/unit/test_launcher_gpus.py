"""Local RaaS workers and the recipe's rollout.gpus: one GPU each when several are listed."""

from __future__ import annotations

from astraflow.launch.up import worker_gpus


def test_several_workers_take_one_listed_gpu_each_in_turn() -> None:
    assert [worker_gpus("1,2,3", i, 3) for i in range(3)] == ["1", "2", "3"]
    assert [worker_gpus("0,1", i, 4) for i in range(4)] == ["0", "1", "0", "1"]


def test_one_worker_or_one_gpu_keeps_the_whole_list() -> None:
    assert worker_gpus("0,1", 0, 1) == "0,1"
    assert worker_gpus("0", 2, 3) == "0"
    assert worker_gpus("", 1, 2) == ""
