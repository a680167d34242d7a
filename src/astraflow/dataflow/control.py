"""An operator's hold on the run: admission paused (per policy or for the whole run) and a clean stop.

Paused admission queues no new prompts for the paused policies and leases no queued task that feeds
only paused policies; tasks already leased finish, and trainers keep consuming what is buffered. The
paused set lives in stage_state under policy "" (no schema change), so a restarted controller stays
paused. A stop is not stored: it ends this controller's run (members stop, trainers checkpoint the
step they hold and exit 0), and starting the run again continues it, unpaused.
"""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.state.paused import ALL, ROW_POLICY, ROW_STAGE, leasable, read
from astraflow.state.store import Store


class RunControl:
    """The paused policies and the stop flag the controller consults before admitting or leasing."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.paused: set[str] = set(read(store)["paused"])
        self.stopped = False

    def is_paused(self, policy: str) -> bool:
        """True if this policy's admission is paused (by itself or with the whole run)."""
        return ALL in self.paused or policy in self.paused

    def admit(self, plan: list[list[str]]) -> list[list[str]]:
        """The admission plan without paused policies: each task feeds only unpaused ones."""
        if not self.paused:
            return plan
        out = [[p for p in feeds if not self.is_paused(p)] for feeds in plan]
        return [feeds for feeds in out if feeds]

    def may_lease(self, feeds: Iterable[str]) -> bool:
        """False for a queued task whose every fed policy is paused (it waits in the queue)."""
        return leasable(self.paused, feeds)

    def pause(self, policy: str) -> None:
        """Pause one policy's admission ("" or "*": the whole run); stored at once."""
        self.paused.add(policy or ALL)
        self._save()

    def resume(self, policy: str) -> None:
        """Resume one policy ("" or "*": everything paused, the whole run included); stored at once."""
        if policy in ("", ALL):
            self.paused.clear()
        else:
            self.paused.discard(policy)
        self._save()

    def stop(self) -> None:
        """End the run after the steps in flight; pauses are lifted for the next start."""
        self.stopped = True
        self.paused.clear()
        self._save()

    def end_reason(self, finished: bool) -> str:
        """Why the run ends, for the log."""
        return "every policy reached its step budget" if finished else "an operator stopped the run"

    def _save(self) -> None:
        self.store.save_stage_state(ROW_POLICY, ROW_STAGE, "control", {"paused": sorted(self.paused)})
