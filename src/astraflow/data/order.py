"""Buffer orders: FIFO (arrival) and EDF (oldest token version first, the published default)."""

from __future__ import annotations

from typing import Any

from astraflow.data.base import BufferItem, BufferOrder


class FifoOrder(BufferOrder):
    """Serve trajectories in arrival order."""

    def sort_key(self, item: BufferItem) -> tuple[Any, ...]:
        return (item.arrival,)


class EdfOrder(BufferOrder):
    """Earliest deadline first: the oldest min token version (closest to expiring) is served first."""

    def sort_key(self, item: BufferItem) -> tuple[Any, ...]:
        return (item.min_version, item.arrival)
