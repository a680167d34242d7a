"""Running model-written code against a task's tests in astraflow.sandbox, for both task kinds.

function: the candidate function, the hidden `check(candidate)` and the call run as one program; it
passes when the program exits 0. stdio: the candidate program runs once per test with the test's
input on stdin; a test passes when the run exits 0 and its stdout matches the expected output token by
token (numbers within 1e-6, so "3.0" matches "3" but "4" never matches "3").
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass
from typing import Any

from astraflow.sandbox import SandboxPool

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The last ```python block of a chat answer, or the whole text when it has none."""
    blocks = CODE_BLOCK.findall(text)
    return str(blocks[-1]) if blocks else text


def candidate(task: dict[str, Any], completion: str, chat: bool) -> str:
    """The candidate code: a chat answer's last code block, or the raw prompt's code continued."""
    if chat:
        return extract_code(completion)
    prefix = task["prompt"] if task.get("kind", "function") == "function" else task.get("starter", "")
    return str(prefix) + completion


def function_program(task: dict[str, Any], code: str) -> str:
    """The program that runs the hidden tests of a function task against `code`."""
    return f"{code}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"


def _token_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def outputs_match(got: str, want: str) -> bool:
    """Whitespace-insensitive, token by token comparison of a program's output with the expected one."""
    g, w = got.split(), want.split()
    return len(g) == len(w) and all(_token_equal(a, b) for a, b in zip(g, w, strict=True))


@dataclass(frozen=True)
class CheckResult:
    """How a candidate did on a task's tests."""

    passed: bool
    """Every test passed."""
    passed_tests: int
    """Tests passed (function tasks: 1 or 0, the check is one program)."""
    total: int
    """Tests run."""
    timeout: bool
    """Some run hit the wall clock."""


async def check(pool: SandboxPool, task: dict[str, Any], code: str) -> CheckResult:
    """Run `code` against the task's hidden tests in the sandbox."""
    if task.get("kind", "function") == "function":
        r = await pool.run(function_program(task, code))
        return CheckResult(r.status == "ok", int(r.status == "ok"), 1, r.status == "timeout")
    tests = task["tests"]
    results = await asyncio.gather(*(pool.run(code, stdin=t["input"].encode()) for t in tests))
    ok = [
        r.status == "ok" and outputs_match(r.stdout.decode("utf-8", "replace"), t["output"])
        for r, t in zip(results, tests, strict=True)
    ]
    return CheckResult(all(ok), sum(ok), len(ok), any(r.status == "timeout" for r in results))
