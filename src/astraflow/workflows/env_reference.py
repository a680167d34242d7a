"""A small reference environment server for the env_server protocol (stdlib only), for tests and smoke runs.

The game: the server names a word and the policy must say it. `reset` picks the word from the task's
index; each `step` answers "done" when the action contains the word, else asks again; `reward` is 1.0
for the word on the first turn, 0.5 later, 0.0 never. Run it with

    python -m astraflow.workflows.env_reference --port 8700

It prints `listening on http://127.0.0.1:PORT` once ready (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = ("apple", "river", "stone", "cloud", "seven", "green", "music", "table")


class Game:
    """The sessions of the word game."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new session for the task."""
        task = body.get("task")
        if not isinstance(task, dict):
            raise ValueError("reset needs a 'task' object")
        word = WORDS[int(task.get("index", 0)) % len(WORDS)]
        session = secrets.token_hex(8)
        with self.lock:
            self.sessions[session] = {"word": word, "turns": 0, "said": 0}
        return {"session": session, "observation": f"Say the word {word}.", "system": "Repeat words."}

    def _get(self, body: dict[str, Any]) -> dict[str, Any]:
        state = self.sessions.get(str(body.get("session")))
        if state is None:
            raise KeyError("unknown session")
        return state

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        """One action."""
        action = body.get("action")
        if not isinstance(action, str):
            raise ValueError("step needs an 'action' string")
        with self.lock:
            state = self._get(body)
            state["turns"] += 1
            if state["word"] in action.lower() and not state["said"]:
                state["said"] = state["turns"]
        if state["said"]:
            return {"observation": "Well done.", "done": True}
        return {"observation": f"No. Say the word {state['word']}.", "done": False}

    def reward(self, body: dict[str, Any]) -> dict[str, Any]:
        """The episode's reward; ends the session."""
        with self.lock:
            state = self._get(body)
            del self.sessions[str(body.get("session"))]
        said = state["said"]
        value = 0.0 if not said else (1.0 if said == 1 else 0.5)
        return {"reward": value, "info": {"turns": state["turns"]}}


def make_server(port: int = 0) -> ThreadingHTTPServer:
    """The reference server bound to 127.0.0.1:port (not yet serving)."""
    game = Game()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            name = self.path.strip("/")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if name not in ("reset", "step", "reward") or not isinstance(body, dict):
                    raise LookupError(f"no call {name!r}")
                status, out = 200, getattr(game, name)(body)
            except LookupError as exc:
                status, out = 404, {"error": str(exc)}
            except ValueError as exc:
                status, out = 400, {"error": str(exc)}
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per call is noise
            return

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main() -> None:
    """Serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8700)
    args = parser.parse_args()
    server = make_server(args.port)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
