"""A small reference environment server for the env_server protocol (stdlib only), for tests and smoke runs.

The game: the server names a word and the policy must say it. `reset` picks the word from the task's
index; each `step` answers "done" when the action contains the word, else asks again; `reward` is 1.0
for the word on the first turn, 0.5 later, 0.0 never.

`--game lookup` is a tool game: `reset` offers one tool, `lookup(key)`, and asks for the value of a key;
a step's tool calls are answered as tool results (the value, or an error text), and the episode is done
when the action contains the value: reward 1.0 if the policy called `lookup` first, 0.5 if it
answered without it, 0.0 never. The key and its value follow the task's index (k0 is always "apple");
with `--draw` both are drawn per task from its seed and index (the key from k0..k{keys-1}), so a model
cannot learn the answers, only to look them up, and tasks of another seed are held out.

    python -m astraflow.workflows.env_protocol.reference --port 8700 [--game lookup [--draw] [--keys N]]
    python -m astraflow.workflows.env_protocol.reference --sft-rows 64 [--draw --sft-seed S] > lookup-sft.jsonl

It prints `listening on http://127.0.0.1:PORT` once ready (port 0 picks a free one). It serves each
request on its own thread with a listen backlog of BACKLOG connections, so hundreds of concurrent
episodes queue instead of being reset. `reward` is idempotent: a session it scored answers the same
again (the last SCORED_KEPT scored sessions are kept).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = ("apple", "river", "stone", "cloud", "seven", "green", "music", "table")
BACKLOG = 1024
"""Listen backlog (the kernel caps it at net.core.somaxconn)."""
SCORED_KEPT = 4096
"""Scored sessions remembered so that a repeated `reward` answers the same."""
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


class Game:
    """The sessions of the word game (or, with tools=True, the lookup game; draw=True draws each task's
    key among `keys` and its value from the task's seed and index)."""

    def __init__(self, tools: bool = False, *, draw: bool = False, keys: int = len(WORDS)) -> None:
        self.tools = tools
        self.draw = draw
        self.keys = keys
        self.sessions: dict[str, dict[str, Any]] = {}
        self.scored: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.lock = threading.Lock()

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new session for the task."""
        task = body.get("task")
        if not isinstance(task, dict):
            raise ValueError("reset needs a 'task' object")
        index = int(task.get("index", 0))
        if self.draw:
            rng = random.Random(f"{task.get('seed', 0)}:{index}")
            key, word = f"k{rng.randrange(self.keys)}", rng.choice(WORDS)
        else:
            key, word = f"k{index % len(WORDS)}", WORDS[index % len(WORDS)]
        session = secrets.token_hex(8)
        with self.lock:
            self.sessions[session] = {
                "word": word,
                "key": key,
                "turns": 0,
                "said": 0,
                "looked": 0,
                "calls": 0,
            }
        if self.tools:
            return {
                "session": session,
                "observation": f"What is the value of {key}? Use the lookup tool, then say the value.",
                "system": "Answer with the value.",
                "tools": [LOOKUP_TOOL],
            }
        return {"session": session, "observation": f"Say the word {word}.", "system": "Repeat words."}

    def _get(self, body: dict[str, Any]) -> dict[str, Any]:
        state = self.sessions.get(str(body.get("session")))
        if state is None:
            raise KeyError("unknown session")
        return state

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        """One action (with its tool calls, in the lookup game)."""
        action = body.get("action")
        if not isinstance(action, str):
            raise ValueError("step needs an 'action' string")
        calls = body.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError("'tool_calls' must be a list")
        results = []
        with self.lock:
            state = self._get(body)
            state["turns"] += 1
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(call.get("id"), str):
                    raise ValueError("each tool call needs an 'id' and a 'function'")
                state["calls"] += 1
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = None
                if fn.get("name") != "lookup" or not isinstance(args, dict):
                    content = f"error: no tool {fn.get('name')!r}, or its arguments are not a JSON object"
                elif args.get("key") == state["key"]:
                    state["looked"] = state["looked"] or state["turns"]
                    content = state["word"]
                else:
                    content = f"error: no key {args.get('key')!r}"
                results.append({"tool_call_id": call["id"], "content": content})
            if state["word"] in action.lower() and not calls and not state["said"]:
                state["said"] = state["turns"]
        if state["said"]:
            return {"observation": "Well done.", "done": True}
        if results:
            return {"tool_results": results, "done": False}
        ask = (
            f"No. What is the value of {state['key']}?"
            if self.tools
            else f"No. Say the word {state['word']}."
        )
        return {"observation": ask, "done": False}

    def reward(self, body: dict[str, Any]) -> dict[str, Any]:
        """The episode's reward; ends the session (a repeated call answers the same)."""
        session = str(body.get("session"))
        with self.lock:
            if session in self.scored:
                return self.scored[session]
            state = self._get(body)
            del self.sessions[session]
            said = state["said"]
            if self.tools:
                value = 0.0 if not said else (1.0 if state["looked"] and state["looked"] < said else 0.5)
            else:
                value = 0.0 if not said else (1.0 if said == 1 else 0.5)
            out = {"reward": value, "info": {"turns": state["turns"], "tool_calls": state["calls"]}}
            self.scored[session] = out
            while len(self.scored) > SCORED_KEPT:
                self.scored.popitem(last=False)
        return out


def sft_rows(n: int, *, draw: bool = False, keys: int = len(WORDS), seed: int = 0) -> list[dict[str, Any]]:
    """`n` SFT rows (astraflow sft's chat form) that solve the lookup game as a policy sees it: the
    tools, the system and user messages of `reset`, an assistant tool call, the tool result, the answer
    (tasks 0..n-1 of `seed`; give a seed no run uses for held-out tasks)."""
    game = Game(tools=True, draw=draw, keys=keys)
    rows = []
    for i in range(n):
        start = game.reset({"task": {"index": i, "seed": seed}})
        state = game.sessions.pop(start["session"])
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"key": state["key"]})},
        }
        rows.append(
            {
                "tools": start["tools"],
                "messages": [
                    {"role": "system", "content": start["system"]},
                    {"role": "user", "content": start["observation"]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "name": "lookup", "content": state["word"]},
                    {"role": "assistant", "content": state["word"]},
                ],
            }
        )
    return rows


class Server(ThreadingHTTPServer):
    """A thread per request, a large listen backlog, daemon threads (a stop never waits for a call)."""

    request_queue_size = BACKLOG
    daemon_threads = True


def make_server(
    port: int = 0, *, tools: bool = False, draw: bool = False, keys: int = len(WORDS)
) -> ThreadingHTTPServer:
    """The reference server bound to 127.0.0.1:port (not yet serving); tools=True: the lookup game."""
    game = Game(tools, draw=draw, keys=keys)

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

    return Server(("127.0.0.1", port), Handler)


def main() -> None:
    """Serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--game", choices=("word", "lookup"), default="word")
    parser.add_argument(
        "--sft-rows", type=int, default=0, help="print this many lookup-game SFT rows and exit"
    )
    parser.add_argument(
        "--draw", action="store_true", help="lookup: draw each task's key and value from its seed and index"
    )
    parser.add_argument("--keys", type=int, default=len(WORDS), help="lookup --draw: keys k0..k{N-1}")
    parser.add_argument("--sft-seed", type=int, default=0, help="--sft-rows: the tasks' seed")
    args = parser.parse_args()
    if args.keys < 1:
        parser.error("--keys must be at least 1")
    if args.sft_rows:
        for row in sft_rows(args.sft_rows, draw=args.draw, keys=args.keys, seed=args.sft_seed):
            print(json.dumps(row))
        return
    server = make_server(args.port, tools=args.game == "lookup", draw=args.draw, keys=args.keys)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
