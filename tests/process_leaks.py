"""Processes a test leaves running: found after each test (and after each fixture wider than a test),
killed, and reported with the test's name.

How a process is known to be a test's (read from /proc, Linux only; elsewhere the check is off):
- by a tag in its environment: before each test's setup, `TAG_VAR` in this process's environment is
  set to a tag of that test, so every process it starts with the inherited environment, and every
  process those start, carries it, wherever it ends up (a new session, or reparented to init when
  its parent died: an `up` killed with its roles still running);
- by descent: an untagged process (a fork, or started with an environment of its own, such as the
  sandbox's) that descends from this pytest process and was not there before the test.

A fixture wider than a test (module, class, session) gets a tag of its own while it is set up, and
the processes it starts are checked after it is finished, not after the test that set it up.
What it does not see: a process that was started with an environment of its own by a process that
is no longer there (its tag lost and its parent gone, so nothing links it to the test). Not a test's:
the `HELPERS` a library starts once for this pytest process. A process that a wide fixture's object
starts later, during a test, is that test's.

A process still alive `GRACE_S` after its owner ended is killed (SIGKILL) and reported: as a warning
on the test, in a "processes left running" section of the summary, and as an error of the test (for
a fixture, of the test in whose teardown it finished) when `ASTRAFLOW_TEST_LEAKS=error`.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
import warnings
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TAG_VAR = "ASTRAFLOW_TEST_PROCESS_TAG"
"""The environment variable whose value names the test (or fixture) that started a process."""
GRACE_S = float(os.environ.get("ASTRAFLOW_TEST_LEAK_GRACE_S", "5"))
"""How long a process may take to end after its owner did (a finalizer that signals and moves on)."""
HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers a library starts once for the whole process that asked (torch's shared-memory manager,
multiprocessing's resource tracker): started by this pytest process during some test, they serve the
later tests too and end with pytest, so they are not that test's; killing one would break the next."""
ON = sys.platform == "linux" and Path("/proc/self/stat").exists()
_PROC = Path("/proc")


class LeakedProcessWarning(UserWarning):
    """A test left processes running after it ended."""


Key = tuple[int, int]
"""A process as (pid, start time in clock ticks after boot): it names the process even if its pid is
reused later."""


def scan() -> dict[Key, int]:
    """Every live process (zombies are dead: left out), of any user (a sandboxed program runs under a
    uid of its own), with its parent's pid."""
    out = {}
    for entry in os.scandir(_PROC):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] not in ("Z", "X"):
                out[(int(entry.name), st[2])] = st[1]
    return out


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, None when it is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _tag(pid: int) -> str:
    """The process's `TAG_VAR` as it was started ("" when it has none or is another user's)."""
    try:
        env = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return ""
    key = TAG_VAR.encode() + b"="
    for entry in env.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode(errors="replace")
    return ""


def _cmd(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def descendants(procs: dict[Key, int], root: int) -> set[Key]:
    """The processes below `root` in the parent tree."""
    children: dict[int, list[Key]] = {}
    for key, ppid in procs.items():
        children.setdefault(ppid, []).append(key)
    out: set[Key] = set()
    todo = [root]
    while todo:
        for key in children.get(todo.pop(), []):
            out.add(key)
            todo.append(key[0])
    return out


def _helper(key: Key) -> bool:
    """Whether the process is one of `HELPERS` started by this pytest process."""
    st = _stat(key[0])
    return st is not None and st[1] == os.getpid() and any(h in _cmd(key[0]) for h in HELPERS)


def _alive(key: Key) -> bool:
    st = _stat(key[0])
    return st is not None and st[2] == key[1] and st[0] not in ("Z", "X")


def _kill(keys: list[Key]) -> None:
    """SIGKILL each (if it is still the same process, not a later one under its pid); wait until
    they are gone, so the next check does not see them again."""
    for key in keys:
        if _alive(key):
            try:
                os.kill(key[0], signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + GRACE_S
    while any(_alive(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)


@dataclass
class Owner:
    """A test or a wide fixture: the tag it gives its processes, the processes there were before
    it started, and (a fixture) the untagged ones it started."""

    name: str
    tag: str
    before: set[Key]
    untagged: set[Key] = field(default_factory=set)


@dataclass
class Leak:
    """Processes an owner left running."""

    owner: str
    procs: list[tuple[int, int, str]]
    """pid, parent pid, command line."""

    def describe(self) -> str:
        """One line per process, under the owner's name."""
        lines = [f"{self.owner} left {len(self.procs)} process(es) running (killed):"]
        lines += [f"  pid {pid} (parent {ppid}): {cmd}" for pid, ppid, cmd in self.procs]
        return "\n".join(lines)


class LeakCheck:
    """The pytest plugin: tags owners, checks after each, kills and reports what they left."""

    def __init__(self) -> None:
        self.base = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.count = 0
        self.fixtures: dict[int, Owner] = {}
        """Wide fixtures set up and not finished yet, by id of their FixtureDef."""
        self.leaks: list[Leak] = []
        self.error = os.environ.get("ASTRAFLOW_TEST_LEAKS", "") == "error"

    def _owner(self, name: str) -> Owner:
        self.count += 1
        return Owner(name, f"{self.base}-{self.count}", set(scan()))

    def _new(self, owner: Owner) -> tuple[dict[Key, int], dict[Key, str]]:
        """Every live process, and the tags of those started since `owner` was (only they can carry
        its tag; reading every environment would cost more)."""
        procs = scan()
        return procs, {k: _tag(k[0]) for k in procs if k not in owner.before}

    def _untagged_new_below_us(self, procs: dict[Key, int], tags: dict[Key, str]) -> set[Key]:
        """New processes below us that no owner of this session tagged (a fork shows the tag, if
        any, this pytest process was started with: a pytest run by a test of another)."""
        return {k for k in descendants(procs, os.getpid()) if k in tags and not tags[k].startswith(self.base)}

    def _left_by_test(self, owner: Owner) -> list[Key]:
        """What a test left: its tagged processes, and new untagged ones below us no wide fixture
        started."""
        procs, tags = self._new(owner)
        fixtures = set().union(*(o.untagged for o in self.fixtures.values()))
        left = {k for k, tag in tags.items() if tag == owner.tag}
        left |= self._untagged_new_below_us(procs, tags) - fixtures
        return self._wait(left)

    def _left_by_fixture(self, owner: Owner) -> list[Key]:
        """What a wide fixture left: its tagged processes and the untagged ones its setup started."""
        _procs, tags = self._new(owner)
        left = {k for k, tag in tags.items() if tag == owner.tag} | {k for k in owner.untagged if _alive(k)}
        return self._wait(left)

    @staticmethod
    def _wait(left: set[Key]) -> list[Key]:
        """Those of `left` still alive after up to GRACE_S (this process's helpers are left out)."""
        deadline = time.monotonic() + GRACE_S
        alive = [k for k in left if _alive(k) and not _helper(k)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [k for k in alive if _alive(k)]
        return sorted(alive)

    def _report(self, owner: str, left: list[Key]) -> str:
        procs = [(pid, (_stat(pid) or ("", -1, 0))[1], _cmd(pid)) for pid, _ in left]
        _kill(left)
        leak = Leak(owner, procs)
        self.leaks.append(leak)
        text = leak.describe()
        warnings.warn(LeakedProcessWarning(text), stacklevel=1)
        return text

    # ----- hooks ----------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, Any]:
        """Tag the test before its fixtures start anything."""
        owner = item.stash[_OWNER] = self._owner(item.nodeid)
        os.environ[TAG_VAR] = owner.tag
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, Any]:
        """After the test's teardown (its fixtures finished): what it left running."""
        try:
            result = yield
        finally:
            os.environ.pop(TAG_VAR, None)
        owner = item.stash.get(_OWNER, None)
        if owner is None:
            return result
        left = self._left_by_test(owner)
        if left:
            text = self._report(owner.name, left)
            if self.error:
                pytest.fail(text, pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_fixture_setup(
        self, fixturedef: Any, request: pytest.FixtureRequest
    ) -> Generator[None, Any, Any]:
        """A fixture wider than a test owns what it starts while it is set up."""
        if fixturedef.scope == "function":
            return (yield)
        owner = self._owner(f"fixture {fixturedef.argname} ({fixturedef.scope} scope)")
        outer = os.environ.get(TAG_VAR)
        os.environ[TAG_VAR] = owner.tag
        try:
            return (yield)
        finally:
            if outer is None:
                os.environ.pop(TAG_VAR, None)
            else:
                os.environ[TAG_VAR] = outer
            owner.untagged = self._untagged_new_below_us(*self._new(owner))
            self.fixtures[id(fixturedef)] = owner

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: pytest.FixtureRequest) -> None:
        """A wide fixture finished: what it started must have ended with it."""
        owner = self.fixtures.pop(id(fixturedef), None)
        if owner is None:
            return
        left = self._left_by_fixture(owner)
        if left:
            text = self._report(owner.name, left)
            if self.error:  # an error of the test in whose teardown the fixture finished
                pytest.fail(text, pytrace=False)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Every leak of the session, once more, in a section of its own."""
        if not self.leaks:
            return
        terminalreporter.section("processes left running")
        for leak in self.leaks:
            terminalreporter.line(leak.describe())


_OWNER = pytest.StashKey[Owner]()


def pytest_configure(config: pytest.Config) -> None:
    """Register the check (off where there is no /proc)."""
    if ON and not config.pluginmanager.has_plugin("process-leaks"):
        config.pluginmanager.register(LeakCheck(), "process-leaks")
