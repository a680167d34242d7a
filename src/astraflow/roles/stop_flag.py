"""A role's stop flag: signals set it, its loop checks it at safe points (never an exception raised
from inside whatever runs when the signal comes)."""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopFlag:
    """Set by SIGTERM or SIGINT: the trainer checks it between the steps of its loop and inside its long
    polls, so a signal never interrupts a checkpoint, a publish or a request half-way."""

    def __init__(self) -> None:
        self.signum = 0
        self._event = threading.Event()

    def install(self) -> StopFlag:
        """Handle SIGTERM and SIGINT from now on (main thread only); returns self."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.set)
        return self

    def set(self, signum: int, _frame: Any = None) -> None:
        """Ask the loop to stop (the signal handler)."""
        self.signum = signum
        self._event.set()

    def __call__(self) -> bool:
        """Whether a stop was asked (the predicate requests take)."""
        return self._event.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep, ending early on a stop."""
        self._event.wait(seconds)

    @property
    def exit_code(self) -> int:
        """The process exit code a stop by this signal ends with (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signum
