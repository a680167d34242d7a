"""The calculator game both paths play: a two-number question, three tools, the answer.

A task is {"index": i, "seed": s}; its question is drawn from them ("What is 37 times 52?"), so tasks
of another seed are unseen. The calculator holds the question's two numbers; its tools `add`,
`subtract` and `multiply` take no arguments and return the result. Two-digit products and sums are
out of reach of a small model's own arithmetic, so the answer needs the tool, and the right tool is the
one the question's word names. Reward 1.0 when the final answer is the right number.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

OPS = {"add": "plus", "subtract": "minus", "multiply": "times"}
"""Tool name -> the word of the question that asks for it."""
SYSTEM = "The calculator holds the two numbers. Call one tool, then say its result."
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in OPS
]
"""The OpenAI function tools offered in every episode."""
NUMBER = re.compile(r"-?\d+")


def problem(task: dict[str, Any]) -> dict[str, Any]:
    """The task's numbers, operation and question, drawn from its seed and index."""
    rng = random.Random(f"calc:{int(task.get('seed', 0))}:{int(task.get('index', 0))}")
    op = rng.choice(sorted(OPS))
    x, y = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
    return {"op": op, "x": x, "y": y, "question": f"What is {x} {OPS[op]} {y}?"}


def run_tool(task: dict[str, Any], name: str) -> str:
    """What the calculator answers to a call of `name` (an error text for an unknown tool)."""
    p = problem(task)
    if name == "add":
        return str(p["x"] + p["y"])
    if name == "subtract":
        return str(p["x"] - p["y"])
    if name == "multiply":
        return str(p["x"] * p["y"])
    return f"error: no tool {name!r}"


def answer(task: dict[str, Any]) -> str:
    """The right answer."""
    return run_tool(task, problem(task)["op"])


def score(task: dict[str, Any], text: str | None) -> float:
    """1.0 when the last number of the final answer is the right one."""
    numbers = NUMBER.findall(text or "")
    return float(bool(numbers) and numbers[-1] == answer(task))


def tasks(seed: int, size: int = 0) -> list[dict[str, Any]]:
    """Tasks 0..size-1 of `seed` (1024 when size is 0)."""
    return [{"index": i, "seed": seed} for i in range(size or 1024)]


def sft_rows(n: int, seed: int, *, teach: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`n` warm-start conversations (astraflow sft's chat rows) of tasks of `seed`: the system and user
    messages, a tool call, its result, the result said as the answer. Questions of the operations in
    `teach` call the right tool; the others call one drawn uniformly from the three. So the rows teach
    the call format, copying the result, and reading the question's word for the taught operations
    only; which tool the other questions need is left to RL."""
    unknown = sorted(set(teach) - set(OPS))
    if unknown:
        raise ValueError(f"unknown operations {unknown}; the tools are {sorted(OPS)}")
    rng = random.Random(f"sft:{seed}")
    rows = []
    for i in range(n):
        task = {"index": i, "seed": seed}
        p = problem(task)
        name = p["op"] if p["op"] in teach else rng.choice(sorted(OPS))
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        result = run_tool(task, name)
        rows.append(
            {
                "tools": TOOLS,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": p["question"]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "name": name, "content": result},
                    {"role": "assistant", "content": result},
                ],
            }
        )
    return rows


def main() -> None:
    """`python -m calc_agent.game --sft-rows N --seed S [--teach add,...]`: print warm-start rows."""
    import argparse

    ap = argparse.ArgumentParser(description="print warm-start conversations of the calculator game")
    ap.add_argument("--sft-rows", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=100, help="a seed no run trains or evaluates on")
    ap.add_argument(
        "--teach", default="add,multiply", help="operations whose rows call the right tool ('' none)"
    )
    args = ap.parse_args()
    teach = tuple(x for x in args.teach.split(",") if x)
    try:
        rows = sft_rows(args.sft_rows, args.seed, teach=teach)
    except ValueError as exc:
        ap.error(str(exc))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
