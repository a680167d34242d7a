"""Admission (and a step's metrics row) read the buffered trajectories' counts from the buffer's
memory once the buffer keeps them: after every message of whole steps through a real Controller on
a real state.db (no sockets), the kept counts equal what state.db counts, and so does the work
admission sees ahead."""

from __future__ import annotations

import random
from pathlib import Path

from astraflow.bench import control_inproc
from astraflow.bench.control import POLICY
from astraflow.protocol import messages as m
from astraflow.state import trajectories


class _Checked(control_inproc._Driver):
    """The bench's driver, comparing the kept counts with the store's after every message."""

    checks = 0

    def send(self, ident: str, msg: m.Msg) -> list[m.Msg]:
        replies = super().send(ident, msg)
        buffer, admission, store = self.ctl.buffer, self.ctl.admission, self.ctl.store
        stored = trajectories.count(store, POLICY, "buffered")
        groups = trajectories.buffered_groups_by_policy(store).get(POLICY, 0)
        kept = buffer.kept_buffered(POLICY)
        if kept is not None:  # kept from the policy's first batch on
            assert kept == stored
            assert buffer.kept_groups(POLICY) == groups
            assert buffer.open_counts(POLICY)["buffered"] == stored  # the step's metrics row
            self.checks += 1
        from_memory = admission.outstanding(), admission.outstanding_groups()
        admission.kept = None
        try:
            assert (admission.outstanding(), admission.outstanding_groups()) == from_memory
        finally:
            admission.kept = buffer
        return replies


def test_kept_buffered_counts_match_the_store(tmp_path: Path) -> None:
    d = _Checked(tmp_path)
    control_inproc.join(d)
    control_inproc.run_steps(d, 1, 3, random.Random(0), 3)
    assert d.checks > 5  # results stored and batches taken while kept, each compared
    d.ctl.store.close()
