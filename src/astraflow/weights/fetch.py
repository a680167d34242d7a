"""Get one weight version onto a worker over the ZeroMQ pull path: by delta chain or full snapshot,
from a relay in the worker's region or from the trainer, always verified against the full version's
sha256 before anything is returned.

Order of attempts: the delta chain from the version the worker holds, from each source in turn
(relays first, then the trainer), then the full snapshot from each source in turn. A source that is
unreachable, silent for `idle_timeout_s` (a relay that died mid-transfer), lacks what is asked for, or
sends bytes that fail a check is skipped; a relay still fetching the version (`not_yet`) is asked
again for up to `relay_wait_s`. A patched version whose digest is wrong is discarded (the held
version stays as it was) and the full snapshot is pulled instead: wrong weights are never returned.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    from astraflow.weights.client import RecvBuffers
    from astraflow.weights.server import WeightServer

_log = log.get("weights.fetch")


@dataclass
class Fetched:
    """A verified version: its tensors (views of the held blob) and how it came."""

    version: int
    state_dict: dict[str, Any]
    kind: str
    """"full", "delta" (a chain of `chain` deltas patched onto the held version) or "held"."""
    source: str
    """Address of the weight server it came from ("" when already held)."""
    nbytes: int
    """Bytes transferred."""
    chain: int = 0
    release: Callable[[], None] | None = None
    """Hands the blob's buffer back to the `into` pool once nothing reads the tensors (full pulls
    that are not held only)."""


@dataclass
class _Entry:
    version: int
    blob: memoryview
    sha256: str


class HeldWeights:
    """The newest verified full blob per policy a worker holds: the base its deltas patch, and, with a
    relay server, what it serves to its peers (with the deltas it pulled).

    A patch never touches a held blob (an engine may still be reading tensors that view it): it goes
    into a fresh copy, which replaces the held one once its digest checks out.
    """

    def __init__(self, relay: WeightServer | None = None) -> None:
        """Hold versions; publish each into `relay` when given."""
        self.relay = relay
        self._held: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"full": 0, "delta": 0, "held": 0, "relay": 0, "fallback": 0}
        """Pulls by kind, pulls served by a relay, and attempts that failed over to the next way."""

    def get(self, policy: str) -> _Entry | None:
        """The newest held version of a policy, or None."""
        with self._lock:
            return self._held.get(policy)

    def put(self, policy: str, version: int, blob: memoryview, sha256: str, deltas: list[Any]) -> None:
        """Hold a verified blob (and relay it with the deltas that led to it)."""
        with self._lock:
            cur = self._held.get(policy)
            if cur is not None and cur.version >= version:
                return
            self._held[policy] = _Entry(version, blob, sha256)
        if self.relay is not None:
            # checksumming for peers is off the pull's path: the engine gets the version first
            threading.Thread(
                target=self._relay, args=(policy, version, blob, deltas), daemon=True, name="relay-publish"
            ).start()

    def _relay(self, policy: str, version: int, blob: memoryview, deltas: list[Any]) -> None:
        assert self.relay is not None
        for v, d in deltas:
            self.relay.publish(policy, v, d, kind="delta")
        self.relay.publish(policy, version, blob)

    def drop(self, policy: str) -> None:
        """Forget what is held for a policy (its next pull is a full one)."""
        with self._lock:
            self._held.pop(policy, None)


def fetch_version(
    sources: list[str],
    policy: str,
    version: int,
    *,
    expect_sha256: str,
    held: HeldWeights | None = None,
    delta: bool = False,
    max_chain: int = 10,
    timeout_s: float = 60.0,
    idle_timeout_s: float = 10.0,
    relay_wait_s: float = 10.0,
    delta_wait_s: float = 0.0,
    window: int | None = None,
    into: RecvBuffers | None = None,
    connections: int = 0,
) -> Fetched:
    """Pull `policy@version` from the first source (relays first, the trainer last) that serves it.

    With `delta` and a held version at most `max_chain` behind, the delta chain is tried first (a
    trainer still encoding a delta of it is asked again for at most `delta_wait_s`). The
    result is held in `held` (when given) as the base of the next delta; without `held`, a full pull
    lands in a buffer from `into` (when given), which `Fetched.release` hands back. Each pull spreads
    over up to `connections` connections to its source (0: weights/client.py's default). Raises the
    last source's error when no way worked.
    """
    from astraflow.weights.client import DEFAULT_WINDOW, fetch_chain, fetch_weights
    from astraflow.weights.snapshot import bytes_to_state_dict

    if not sources:
        raise ValueError("no weight server to pull from")
    base = held.get(policy) if held is not None else None
    if base is not None and base.version == version and base.sha256 == expect_sha256:
        if held is not None:
            held.counts["held"] += 1
        return Fetched(version, bytes_to_state_dict(base.blob), "held", "", 0)
    win = window or DEFAULT_WINDOW
    trainer = sources[-1]
    attempt = _Attempts(policy, version, trainer, relay_wait_s)
    if delta and base is not None and 0 < version - base.version <= max_chain:
        budget = len(base.blob)

        def chain_from(src: str) -> list[memoryview]:
            return fetch_chain(
                src,
                policy,
                base.version,
                version,
                max_bytes=budget,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                window=win,
                connections=connections,
            )

        for src in sources:
            chain = attempt(chain_from, src, trainer_wait_s=delta_wait_s)
            if chain is None:
                _count(held, "fallback")
                continue
            patched = _patch(base, chain, expect_sha256)
            if patched is None:
                _count(held, "fallback")
                break  # wrong bytes from a verified chain: no source's deltas are to be trusted now
            nbytes = sum(len(d) for d in chain)
            deltas = list(zip(range(base.version + 1, version + 1), chain, strict=True))
            return _done(held, policy, version, patched, expect_sha256, "delta", src, nbytes, deltas, trainer)
    for src in sources:
        blob = attempt(
            lambda s: fetch_weights(
                s,
                policy,
                version,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                expect_sha256=expect_sha256,
                window=win,
                into=into if held is None else None,
                connections=connections,
            ),
            src,
        )
        if blob is not None:
            out = _done(held, policy, version, blob, expect_sha256, "full", src, len(blob), [], trainer)
            if held is None and into is not None:
                out.release = functools.partial(into.give, blob)
            return out
        _count(held, "fallback")
    raise attempt.errors[-1]


class _Attempts:
    """One way of pulling tried on one source; its error is kept (the last one is raised when every
    way failed). A source that answers `not_yet` is asked again: a relay still fetching the version for
    at most relay_wait_s, the trainer (still encoding a delta) for at most the call's trainer_wait_s."""

    def __init__(self, policy: str, version: int, trainer: str, relay_wait_s: float) -> None:
        self.policy, self.version, self.trainer, self.relay_wait_s = policy, version, trainer, relay_wait_s
        self.errors: list[Exception] = []

    def __call__(self, fn: Any, src: str, trainer_wait_s: float = 0.0) -> Any:
        from astraflow.weights.client import NotYetError, VersionUnavailableError

        until = time.monotonic() + (trainer_wait_s if src == self.trainer else self.relay_wait_s)
        while True:
            try:
                return fn(src)
            except NotYetError as exc:
                if time.monotonic() >= until:
                    self.errors.append(exc)
                    return None
                time.sleep(0.1)
            except (AstraflowError, OSError, ValueError) as exc:
                # a delta not held (evicted, or bigger than a full version) is routine
                level = logging.DEBUG if isinstance(exc, VersionUnavailableError) else logging.INFO
                _log.log(level, "pulling %s@%d from %s failed: %s", self.policy, self.version, src, exc)
                self.errors.append(exc)
                return None


def _count(held: HeldWeights | None, what: str) -> None:
    if held is not None:
        held.counts[what] += 1


def _done(
    held: HeldWeights | None,
    policy: str,
    version: int,
    blob: memoryview,
    sha256: str,
    kind: str,
    src: str,
    nbytes: int,
    deltas: list[Any],
    trainer: str,
) -> Fetched:
    from astraflow.weights.snapshot import bytes_to_state_dict

    sd = bytes_to_state_dict(blob)
    if held is not None:
        held.put(policy, version, blob, sha256, deltas)
        held.counts[kind] += 1
        if src != trainer:
            held.counts["relay"] += 1
    return Fetched(version, sd, kind, src, nbytes, len(deltas))


def _patch(base: _Entry, chain: list[memoryview], expect_sha256: str) -> memoryview | None:
    """A copy of the held blob with the chain applied, or None when any delta does not fit or the
    result's digest is not the expected one (the held blob is untouched either way)."""
    from astraflow.weights.delta import DeltaError, apply_delta, read_header
    from astraflow.weights.manifest import blob_digest
    from astraflow.weights.snapshot import bytes_to_state_dict

    buf = mmap.mmap(-1, max(1, len(base.blob)))
    view = memoryview(buf)[: len(base.blob)]
    view[:] = base.blob
    tensors = bytes_to_state_dict(view)
    sha = base.sha256
    try:
        for d in chain:
            if read_header(d).base_sha256 != sha:
                raise DeltaError("a delta of the chain was taken from other bytes than it is applied to")
            sha = apply_delta(tensors, d).target_sha256
    except DeltaError as exc:
        _log.warning("delta chain does not fit the held version: %s; pulling the full version", exc)
        return None
    whole = blob_digest(view)
    if whole != expect_sha256 or sha != expect_sha256:
        _log.warning(
            "patched version has sha256 %s…, expected %s…: discarded; pulling the full version",
            whole[:12],
            expect_sha256[:12],
        )
        return None
    return view
