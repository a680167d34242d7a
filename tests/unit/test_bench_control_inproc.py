"""`bench control --in-process` drives a real Controller on a real state.db through whole steps: every
result is accepted, every step's batch holds the bench's 32 x 16 sequences, and the figures add up."""

from __future__ import annotations

from astraflow.bench import control_inproc


def test_in_process_steps_move_whole_batches() -> None:
    r = control_inproc.run(steps=2, warmup_steps=1, tokens=3, profile=True, top=5)
    assert r["sequences"] == 2 * 32 * 16
    # per step: a task request and a TaskResults per worker, the batch request, the version
    assert r["messages"] == 2 * 6
    assert r["controller_cpu_s"] > 0
    assert abs(r["us_per_sequence"] * r["sequences"] / 1e6 - r["controller_cpu_s"]) < 1e-3
    assert "function calls" in r["profile"]
    assert "us/sequence" in control_inproc.render(r)
