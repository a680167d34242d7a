"""The verify workflow's simulated environment and task lengths: seeded, long-tailed, capped, uneven."""

from __future__ import annotations

import statistics

from astraflow.workflows.quickstart.verify import VerifyEnvConfig, VerifyEnvWorkflow, env_latency


def test_environment_latency_is_seeded_long_tailed_and_capped() -> None:
    cfg = VerifyEnvConfig(env_latency_s=0.5, env_sigma=1.0, env_max_s=8.0)
    draws = [env_latency(cfg, seed, i) for seed in range(500) for i in range(8)]
    assert draws[:8] == [env_latency(cfg, 0, i) for i in range(8)]  # both benchmark modes see the same
    assert 0.4 < statistics.median(draws) < 0.6  # the median is the configured one
    assert max(draws) <= 8.0 and sorted(draws)[int(0.99 * len(draws))] > 6 * statistics.median(draws)
    assert {env_latency(VerifyEnvConfig(env_latency_s=0.5, env_sigma=0.0), s, 0) for s in range(20)} == {0.5}


def test_tasks_have_uneven_lengths_within_bounds() -> None:
    wf = VerifyEnvWorkflow(VerifyEnvConfig(min_length=1, max_length=8, length_tail=0.6))
    tasks = list(wf.dataset(seed=0, size=400))
    lengths = [len(t["digits"]) for t in tasks]
    assert min(lengths) == 1 and max(lengths) == 8 and len(set(lengths)) == 8
    assert lengths.count(1) > lengths.count(8)  # a tail, not a uniform spread
    assert [t["env_seed"] for t in wf.dataset(seed=0, size=5)] == [t["env_seed"] for t in tasks[:5]]
    assert wf.sequences_per_task({"solver": 8, "verifier": 4}) == {"solver": 8, "verifier": 32}
