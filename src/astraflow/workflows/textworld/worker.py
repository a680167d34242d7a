"""TextWorld games in their own processes, so that a crash or a hang of the game engine (jericho's C
interpreter, TextWorld's parser) cannot take the RaaS down with it.

Each worker process plays one game at a time and answers JSON lines on its stdin/stdout:

  {"op": "hello"}                import TextWorld (a fresh worker's first request, on a longer timeout)
  {"op": "start", "path": str}   load a game (closing the one before)
  {"op": "reset"}                its first observation
  {"op": "step", "command": str} one command
  {"op": "close"}                stop the interpreter

Every answer is {"ok": true, "text": str, "admissible": [str], "done": bool, "won": bool, "score": float}
or {"ok": false, "error": str, "hint": str}. The RaaS side (`GameWorkers`) keeps idle workers for the
next episode; a worker that died (exit code or signal) or overran a timeout is killed and replaced, and
the episode fails with an error naming the game. Run `python -m astraflow.workflows.textworld.worker`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

from astraflow.errors import AstraflowError


class GameCrashed(AstraflowError):
    """The game-engine process died or was killed (a crash or a hang), not the RaaS."""


class GameWorker:
    """One game-engine process (blocking calls: use them from a worker thread)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.workflows.textworld.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the engine's own messages land in the RaaS log
            start_new_session=True,  # a Ctrl-C meant for the RaaS goes through the RaaS
        )
        self.game = ""
        self.ready = False
        """Whether it answered "hello" (TextWorld imported)."""

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def call(self, op: dict[str, Any]) -> dict[str, Any]:
        """Send one request and read its answer; GameCrashed when the process is gone."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if op.get("op") == "start":
            self.game = str(op.get("path", ""))
        try:
            self.proc.stdin.write((json.dumps(op) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, ValueError, OSError):
            line = b""
        if not line:
            code = self.proc.wait()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise GameCrashed(
                f"the game engine process ended ({how}) while playing {self.game or 'no game'}",
                hint="the RaaS is unaffected: this episode fails and its task is retried",
            )
        out: dict[str, Any] = json.loads(line)
        if not out.get("ok"):
            raise AstraflowError(str(out.get("error")), hint=str(out.get("hint") or ""))
        return out

    def kill(self) -> None:
        """Stop the process at once (a hung or dead engine)."""
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


class GameWorkers:
    """Idle game-engine processes kept for the next episode (one per episode at a time)."""

    def __init__(self) -> None:
        self._idle: list[GameWorker] = []
        self._lock = threading.Lock()

    def acquire(self) -> GameWorker:
        """An idle live worker, or a new one."""
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                worker.kill()
        return GameWorker()

    def release(self, worker: GameWorker, healthy: bool) -> None:
        """Keep a healthy worker for the next episode; kill any other."""
        if healthy and worker.alive:
            with self._lock:
                self._idle.append(worker)
        else:
            worker.kill()

    def close(self) -> None:
        """Stop every idle worker."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


def _answer(game: Any, text: str) -> dict[str, Any]:
    return {
        "ok": True,
        "text": text,
        "admissible": game.admissible,
        "done": game.done,
        "won": game.won,
        "score": game.score,
    }


def _serve(requests: IO[str], answers: IO[str]) -> None:
    from astraflow.workflows.textworld.games import GameSession, _textworld

    game: GameSession | None = None
    out: dict[str, Any]
    for line in requests:
        try:
            op = json.loads(line)
            name = op.get("op")
            if name == "hello":
                _textworld()
                out = {"ok": True}
            elif name == "start":
                if game is not None:
                    game.close()
                    game = None
                game = GameSession(str(op["path"]))
                out = _answer(game, "")
            elif game is None:
                raise AstraflowError(f"{name!r} before a game was started")
            elif name == "reset":
                out = _answer(game, game.reset())
            elif name == "step":
                out = _answer(game, game.step(str(op["command"])))
            elif name == "close":
                game.close()
                game = None
                out = {"ok": True}
            else:
                raise AstraflowError(f"unknown request {name!r}")
        except AstraflowError as exc:
            out = {"ok": False, "error": exc.message, "hint": exc.hint or ""}
        except Exception as exc:  # the game's own error: reported, the worker keeps serving
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000], "hint": ""}
        answers.write(json.dumps(out) + "\n")
        answers.flush()


def main() -> None:
    """Serve requests until stdin closes (the RaaS ended or let this worker go)."""
    # stdin's end also closes when the RaaS dies; the signal covers an engine busy inside a step
    try:  # also end with the RaaS if it is killed outright
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # answers go out on a private copy of stdout; anything the engine prints goes to stderr instead
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin, answers)


if __name__ == "__main__":
    main()
