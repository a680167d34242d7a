"""The writer connection's transactions: `write()`, and `together()` with its `unit()`s.

`write()` is a `BEGIN IMMEDIATE` transaction (nested uses join the outer one, so a caller can make
several writes atomic). Inside `together()` the writes of several units (`unit()`: one member
message each) share one transaction, each unit and each outermost write a SAVEPOINT of its own, and
commit once when the block ends: the controller's loop handles the messages of one poll this way
and answers them after that COMMIT (roles/controller/service.py, `dispatch_all`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from astraflow.errors import AstraflowError


class StateError(AstraflowError):
    """The state file cannot be opened or does not hold a run."""


class Transactions:
    """The transactions of one connection to state.db (`Store` is built on it)."""

    def __init__(self, conn: sqlite3.Connection, *, readonly: bool) -> None:
        self.conn = conn
        self.readonly = readonly
        self.on_rollback: list[Callable[[], None]] = []
        """Called after a write transaction (or a savepoint) rolled back: holders of in-memory state
        that its statements persist (data stages, the prompt cursor) reload it from the store."""
        self._grouped = False
        """Inside `together()`: writes share one transaction, each unit and outermost write a savepoint."""
        self._lost = False
        """A statement inside `together()` ended its transaction: the block must not commit or answer."""
        self._began = False
        """`together()` opened its transaction."""
        self._in_unit = False
        """Inside a `unit()` (nested units add no savepoint)."""
        self._unit_open = False
        """The current unit's savepoint is open (its first write opened it)."""
        self._writing = False
        """Inside a `write()` within `together()` (nested writes add no savepoint)."""

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A BEGIN IMMEDIATE transaction, committed on exit; inside another write it joins that one.
        Inside `together()` the outermost write is a SAVEPOINT of the shared transaction instead:
        rolled back alone if it raises, committed when that block ends."""
        if self.readonly:
            raise StateError("this store was opened read-only", hint="only the controller writes state.db")
        if self._grouped and not self._writing:
            self._writing = True
            try:
                with self._savepoint("write"):
                    yield self.conn
            finally:
                self._writing = False
            return
        if self.conn.in_transaction:
            yield self.conn
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self._rollback("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextmanager
    def together(self) -> Iterator[None]:
        """One commit for many messages: the writes made inside share one transaction, opened by the
        first of them (none when nothing writes), and commit together when the block ends. A caller
        tells a member what those writes did only after the block returned: then they are on disk.
        If the block or the COMMIT raises, everything since the shared BEGIN is rolled back (the
        rollback holders reload) and the error propagates. Inside another `together()` or a
        transaction it joins that one."""
        if self._grouped or self.conn.in_transaction:
            yield
            return
        self._grouped, self._lost, self._began = True, False, False
        try:
            yield
            if self._lost or (self._began and not self.conn.in_transaction):
                # what earlier units wrote is gone: none of their messages may be answered
                raise StateError("a failed statement rolled back the shared transaction of several messages")
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self._rollback("ROLLBACK")
            raise
        finally:
            self._grouped = False

    @contextmanager
    def unit(self) -> Iterator[None]:
        """One member message inside `together()`: its writes are a SAVEPOINT of the shared
        transaction (opened by its first write: a message that writes nothing costs no statement),
        rolled back together if the block raises (the rollback holders reload; the error
        propagates), so a failing message undoes its own writes and no other's. Outside `together()`,
        or inside another unit, it adds nothing: each `write()` is then its own transaction."""
        if not self._grouped or self._in_unit:
            yield
            return
        self._in_unit, self._unit_open = True, False
        try:
            yield
        except BaseException:
            if self._unit_open:
                self._undo("unit")
            raise
        else:
            if self._unit_open:
                self.conn.execute("RELEASE unit")
        finally:
            self._in_unit = self._unit_open = False

    @contextmanager
    def _savepoint(self, name: str) -> Iterator[None]:
        """A SAVEPOINT of the shared transaction, released on exit or rolled back to if the block
        raises; the first one opens the transaction (BEGIN IMMEDIATE), and the first inside a unit
        opens the unit's savepoint too."""
        if not self.conn.in_transaction:
            self.conn.execute("BEGIN IMMEDIATE")
            self._began = True
        if self._in_unit and not self._unit_open:
            self.conn.execute("SAVEPOINT unit")
            self._unit_open = True
        self.conn.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            self._undo(name)
            raise
        self.conn.execute(f"RELEASE {name}")

    def _undo(self, name: str) -> None:
        """Roll back to savepoint `name` and release it; if SQLite ended the whole transaction
        instead (disk full, ...), mark what earlier units wrote lost, so that `together()` raises."""
        if not self.conn.in_transaction:
            self._lost = True
            self._rollback(None)
            return
        self.conn.execute(f"ROLLBACK TO {name}")
        self._rollback(f"RELEASE {name}")

    def _rollback(self, statement: str | None) -> None:
        """End a rolled-back transaction or savepoint with `statement` (None: SQLite ended it), then
        let the holders of in-memory state that its statements persisted reload it."""
        if statement is not None:
            self.conn.execute(statement)
        for restore in self.on_rollback:
            restore()
