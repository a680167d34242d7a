"""How `bench e2e` reads a policy's pace from its metrics rows: checkpoints inside the measured span
are taken out, the final one (after the last step's end) is not."""

from __future__ import annotations

from astraflow.bench.e2e import read_policies


def _rows(done_at: bool) -> list[dict[str, float]]:
    # steps end 2 s apart (1 s compute); step 1 checkpoints for 0.5 s, the last step for 4 s (final)
    rows = []
    for i, ckpt in enumerate((0.0, 0.5, 0.0, 4.0)):
        r = {"step": i + 1, "trainer_compute_s": 1.0, "trainer_checkpoint_s": ckpt, "batch_size": 8.0}
        if done_at:
            r.update(trainer_done_at=100.0 + 2.0 * i + (0.5 if i >= 2 else 0.0), time=101.0 + 2.0 * i)
        else:
            r["time"] = 100.0 + 2.0 * i + 0.5 * (i >= 1) + 4.0 * (i >= 3)
        rows.append(r)
    return rows


def test_checkpoints_inside_the_span_are_taken_out_the_final_one_is_not() -> None:
    # with trainer_done_at: ends at 100, 102, 104.5, 106.5; step 1's 0.5 s checkpoint lies inside
    pol = read_policies({"main": _rows(done_at=True)}, {}, 0.0, 10.0)["main"]
    assert abs(pol["s_per_step"] - 2.0) < 1e-9
    assert abs(pol["trainer_busy"] - 0.5) < 1e-9
    # rows timed when written, after their own step's checkpoint: steps 2-4's checkpoints are inside
    pol = read_policies({"main": _rows(done_at=False)}, {}, 0.0, 10.0)["main"]
    assert abs(pol["s_per_step"] - 2.0) < 1e-9
    assert pol["trainer_busy"] <= 1.0
