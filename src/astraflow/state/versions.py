"""Questions about a policy's published versions that the Store's own accessors do not answer."""

from __future__ import annotations

from astraflow.state.store import Store


def version_step(store: Store, policy: str, version: int) -> int | None:
    """The step `version` of `policy` was recorded for (None: not recorded)."""
    rows = store.query("SELECT step FROM versions WHERE policy = ? AND version = ?", (policy, version))
    return int(rows[0]["step"]) if rows else None


def published_version(store: Store, policy: str) -> int:
    """The policy's newest published version (0 before its first step, or for an unknown policy)."""
    rows = store.query("SELECT version FROM policies WHERE name = ?", (policy,))
    return int(rows[0]["version"]) if rows else 0


def newest_version(store: Store) -> int:
    """The highest version recorded for any policy (0 when none is)."""
    return int(store.scalar("SELECT MAX(version) FROM versions") or 0)
