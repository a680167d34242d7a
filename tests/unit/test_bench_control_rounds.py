"""bench control's rounds: each row's ratio is against the first row of its own round, and the medians
are taken over the rounds (a host's drift between rounds falls on both member counts alike)."""

from __future__ import annotations

import os
import subprocess
import sys

from astraflow.bench.control_rounds import compare, medians


def _row(members: int, rnd: int, rate: float, rss: float = 100.0) -> dict:
    return {
        "results": "grouped",
        "curve": True,
        "members": members,
        "round": rnd,
        "sequences_per_s": rate,
        "controller_rss_mb": rss,
    }


def test_ratios_pair_each_round_with_its_own_first_row() -> None:
    # round 1 ran on a host twice as slow: against round 0's first row its 10,001 row would read 0.45
    rows = [_row(3, 0, 100.0), _row(10001, 0, 95.0, 200.0), _row(3, 1, 50.0), _row(10001, 1, 45.0, 150.0)]
    compare(rows)
    assert [r["sequences_vs_first"] for r in rows] == [1.0, 0.95, 1.0, 0.9]
    assert rows[1]["rss_kb_per_extra_member"] == round(1024 * 100 / 9998, 1)
    assert rows[0]["rss_kb_per_extra_member"] is None


def test_medians_over_rounds() -> None:
    rows = [_row(3, r, 100.0) for r in range(3)]
    rows += [_row(10001, r, rate) for r, rate in enumerate((80.0, 120.0, 95.0))]
    rows.sort(key=lambda r: (r["round"], r["members"]))
    compare(rows)
    med = {m["members"]: m for m in medians(rows)}
    assert med[10001]["ratio_median"] == 0.95
    assert med[10001]["ratios"] == [0.8, 1.2, 0.95]
    assert med[10001]["sequences_per_s"] == 95.0
    assert med[3]["rounds"] == 3 and med[3]["ratio_median"] == 1.0


def test_zero_rounds_is_refused_before_anything_starts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "bench", "control", "--members", "2", "--repeat", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode != 0
    assert "--repeat >= 1" in out.stderr + out.stdout
