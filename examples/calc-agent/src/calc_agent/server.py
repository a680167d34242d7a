"""The calculator game as an environment server of astraflow's env_server protocol (stdlib HTTP).

    python -m calc_agent.server --port 8702

`reset` offers the tools and asks the question; a `step` with tool calls gets their results; a step
without calls is the final answer and ends the episode; `reward` scores it (and answers the same when
asked again for a session it scored).
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from calc_agent.game import SYSTEM, TOOLS, problem, run_tool, score

KEPT = 4096
"""Scored sessions remembered, so that a repeated `reward` answers the same."""


class Calculator:
    """The sessions of the game."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.scored: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.lock = threading.Lock()

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new session for the task {"index", "seed"}."""
        task = body.get("task")
        if not isinstance(task, dict):
            raise ValueError("reset needs a 'task' object")
        session = secrets.token_hex(8)
        with self.lock:
            self.sessions[session] = {"task": task, "answer": None, "calls": 0, "first_tool": ""}
        return {
            "session": session,
            "system": SYSTEM,
            "observation": problem(task)["question"],
            "tools": TOOLS,
        }

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        """Tool calls get their results; an action without calls is the answer."""
        action, calls = body.get("action"), body.get("tool_calls") or []
        if not isinstance(action, str) or not isinstance(calls, list):
            raise ValueError("step needs an 'action' string and a 'tool_calls' list")
        with self.lock:
            state = self.sessions.get(str(body.get("session")))
            if state is None:
                raise KeyError("unknown session")
            if not calls:
                state["answer"] = action
                return {"done": True}
            results = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(call.get("id"), str):
                    raise ValueError("each tool call needs an 'id' and a 'function'")
                state["calls"] += 1
                state["first_tool"] = state["first_tool"] or str(fn.get("name"))
                results.append(
                    {"tool_call_id": call["id"], "content": run_tool(state["task"], str(fn.get("name")))}
                )
        return {"tool_results": results, "done": False}

    def reward(self, body: dict[str, Any]) -> dict[str, Any]:
        """The episode's reward and info; ends the session."""
        session = str(body.get("session"))
        with self.lock:
            if session in self.scored:
                return self.scored[session]
            state = self.sessions.pop(session, None)
            if state is None:
                raise KeyError("unknown session")
            right = state["first_tool"] == problem(state["task"])["op"]
            out = {
                "reward": score(state["task"], state["answer"]),
                "info": {"calculator_calls": state["calls"], "right_tool": float(right)},
            }
            self.scored[session] = out
            while len(self.scored) > KEPT:
                self.scored.popitem(last=False)
        return out


class Server(ThreadingHTTPServer):
    """A thread per request and a large listen backlog, so concurrent episodes queue."""

    request_queue_size = 1024
    daemon_threads = True


def make_server(port: int = 0) -> Server:
    """The server bound to 127.0.0.1:port (not yet serving)."""
    game = Calculator()

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

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Server(("127.0.0.1", port), Handler)


def main() -> None:
    """Serve until interrupted."""
    ap = argparse.ArgumentParser(description="the calculator game's environment server")
    ap.add_argument("--port", type=int, default=8702)
    server = make_server(ap.parse_args().port)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
