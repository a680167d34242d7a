"""bench control's CPU placement: with --controller-cpu the simulators stay off the controller's whole
physical core (its SMT siblings too), so its core is the controller's alone."""

from __future__ import annotations

import pytest

from astraflow.bench import cpus


def test_cpu_list_reads_the_kernels_formats() -> None:
    assert cpus.cpu_list("0\n") == {0}
    assert cpus.cpu_list("0,8") == {0, 8}
    assert cpus.cpu_list("4-5,12-13") == {4, 5, 12, 13}
    with pytest.raises(ValueError):
        cpus.cpu_list("zero")


def test_core_mates_hold_the_cpu_itself() -> None:
    assert 0 in cpus.core_mates(0)
    assert cpus.core_mates(100_000) == {100_000}  # no such CPU: the kernel says nothing


def test_simulators_keep_off_the_controllers_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(cpus, "core_mates", lambda cpu: {cpu, cpu + 8})  # 8 cores, 2 threads each
    assert cpus.simulator_cpus(0) == set(range(1, 16)) - {8}
    assert cpus.idle_siblings(0) == [8]


def test_a_core_of_two_threads_alone_still_leaves_the_sibling(monkeypatch: pytest.MonkeyPatch) -> None:
    # nothing left apart from the controller's core: the simulators share it rather than not run
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(cpus, "core_mates", lambda cpu: {0, 1})
    assert cpus.simulator_cpus(0) == {1}
    assert cpus.idle_siblings(0) == []
