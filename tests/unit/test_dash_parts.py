"""The dashboard's non-UI parts: the metrics.jsonl tail reader, curves and ETA, sample segments."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.metrics.log import MetricsLog
from astraflow.state.views import Sample
from astraflow.tui.samples import segments, version_span
from astraflow.tui.series import PLOT_POINTS, Series, fmt_duration, mismatch_text


def test_tail_history_and_new_rows_cover_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for s in range(1, 501):
            f.write(json.dumps({"policy": "main", "step": s, "pad": "x" * 100}) + "\n")
        f.write('{"policy": "main", "st')  # a row still being written
    log = MetricsLog(path)
    tail = log.load_tail(max_bytes=4096)
    assert 0 < len(tail) < 500 and tail[-1]["step"] == 500
    history = log.read_history()
    assert [r["step"] for r in history + tail] == list(range(1, 501))
    assert log.read_history() == [] and log.read_new() == []
    with path.open("a") as f:
        f.write('ep": 501}\n{"policy": "main", "step": 502}\n')
    assert [r["step"] for r in log.read_new()] == [501, 502]


def test_series_curves_thin_and_eta() -> None:
    s = Series()
    s.add([{"policy": "main", "step": i, "time": 100.0 + 2 * i, "loss": float(i)} for i in range(501, 1001)])
    s.add(
        [{"policy": "main", "step": i, "time": 100.0 + 2 * i, "loss": float(i)} for i in range(1, 501)],
        prepend=True,
    )
    s.add([{"policy": "main", "step": 1000, "time": 0.0, "loss": -1.0}])  # a step already held is ignored
    xs, ys = s.curve("loss")
    assert len(xs) == PLOT_POINTS and xs[0] == 1.0 and xs[-1] == 1000.0 and ys == xs
    assert s.eta_s(1100) == 200.0  # 100 steps at 2 s per step
    assert fmt_duration(200.0) == "3m20s" and fmt_duration(None) == "-"


def test_segments_split_by_mask_with_versions() -> None:
    smp = Sample(
        id=1, task_id=1, policy="main", prompt_key="k", tokens=[5, 6, 7, 8, 9, 10],
        loss_mask=[0, 0, 1, 1, 0, 1], versions=[-1, -1, 3, 4, -1, 4], reward=1.0, advantage=0.5,
        status="consumed", consumed_step=4,
    )  # fmt: skip
    segs = segments(smp, lambda ids: "|".join(map(str, ids)))
    assert [(g.trained, g.text) for g in segs] == [(False, "5|6"), (True, "7|8"), (False, "9"), (True, "10")]
    assert version_span(segs[1].versions) == "v3..v4" and version_span(segs[0].versions) == "-"


def test_mismatch_text_shows_fresh_and_stale_ratios() -> None:
    row = {
        "trainer/mismatch/ratio_fresh": 1.00002,
        "trainer/mismatch/ratio_stale": 1.25,
        "trainer/mismatch/tokens_stale": 12.0,
    }
    assert mismatch_text(row) == "ratio fresh 1.0000 stale 1.2500  "
    assert mismatch_text({**row, "trainer/mismatch/tokens_stale": 0.0}) == "ratio fresh 1.0000  "
    assert mismatch_text({"loss": 0.1}) == ""
