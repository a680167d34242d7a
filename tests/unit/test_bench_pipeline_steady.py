"""`bench pipeline`'s steady-window ratio: async / sync generated samples a second, from each run's
end-to-end report, printed under the whole-run throughput ratio; absent when a window generated none."""

from __future__ import annotations

from astraflow.bench.pipeline import ModeResult, PolicyPace, add_steady, compare, format_table


def _summary(sync_rate: float, async_rate: float) -> dict:
    runs = [
        ModeResult("sync", "s", ok=True, steps_per_s=1.0, policies={"a": PolicyPace(2, 1.0)}),
        ModeResult("async", "a", ok=True, steps_per_s=2.0, policies={"a": PolicyPace(2, 0.5)}),
    ]
    summary = compare(runs)
    summary["e2e"] = {"sync": {"generated_per_s": sync_rate}, "async": {"generated_per_s": async_rate}}
    return summary


def test_the_steady_ratio_is_async_over_sync_generated_samples() -> None:
    summary = _summary(135.9, 298.9)
    add_steady(summary)
    assert abs(summary["steady_samples_ratio"] - 298.9 / 135.9) < 1e-12
    assert summary["throughput_ratio"] == 2.0  # the whole-run ratio is its own figure
    table = format_table(summary)
    assert "steady windows, samples/s generated: sync 135.9, async 298.9: 2.20x" in table
    assert table.index("async / sync throughput") < table.index("steady windows")


def test_no_steady_ratio_without_both_rates() -> None:
    for summary in (_summary(0.0, 50.0), {"runs": [], "e2e": {"async": {"generated_per_s": 9.0}}}):
        add_steady(summary)
        assert "steady_samples_ratio" not in summary
        assert "steady windows" not in format_table(summary)
