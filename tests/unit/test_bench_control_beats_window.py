"""`bench control`'s beat rates: the beats of the measured window only, not those of the joins."""

from astraflow.bench.control import _beat_rates
from astraflow.bench.control_sim import SLOT_S


def _sim(started: float, ended: float, slots: dict[int, list[int]], intervals: dict[str, int]) -> dict:
    beats = sum(b for b, _ in slots.values())
    acks = sum(a for _, a in slots.values())
    # as the JSON result file has them: slot keys as text
    return {
        "started": started,
        "ended": ended,
        "heartbeats": beats,
        "acks": acks,
        "beats_by_slot": {str(k): v for k, v in slots.items()},
        "idle_intervals": intervals,
    }


def test_window_rate_leaves_out_the_joins_beats() -> None:
    per_s = int(1 / SLOT_S)
    t0, t1 = 1000.0, 1010.0
    # joins: 5,000 beats a second in the 4 s before the window; 200 a second inside it; 5,000 after
    slots = {int((t0 - 4) * per_s) + i: [5000 // per_s, 0] for i in range(4 * per_s)}
    slots |= {int(t0 * per_s) + i: [200 // per_s, 100 // per_s] for i in range(10 * per_s)}
    slots[int(t1 * per_s)] = [5000, 5000]  # a slot after the window: not counted
    a = _sim(t0 - 4, t1 + SLOT_S, slots, {"10.0": 1000, "5.0": 500})
    b = _sim(t0 - 4, t1 + SLOT_S, {int(t0 * per_s) + 1: [50, 0]}, {"0.5": 2})
    rates = _beat_rates([a, b], t0, t1)
    assert rates["heartbeats_per_s"] == 205.0  # 200 + b's 50 beats over the 10 s window
    assert rates["acks_per_s"] == 100.0
    assert rates["heartbeats_per_s_life"] > 1000  # the old measure: the joins' beats counted in
    assert rates["idle_beats_per_s_told"] == 1000 / 10 + 500 / 5 + 2 / 0.5
    assert list(rates["idle_intervals"]) == ["0.5", "5.0", "10.0"]


def test_window_not_on_slot_edges_counts_whole_slots_inside() -> None:
    per_s = int(1 / SLOT_S)
    t0, t1 = 1000.1, 1002.1  # whole slots inside: from 1000.25 to 1002.0
    slots = {int(1000 * per_s) + i: [10, 0] for i in range(3 * per_s)}
    rates = _beat_rates([_sim(t0, t1, slots, {})], t0, t1)
    assert rates["heartbeats_per_s"] == 10 / SLOT_S
