"""Math datasets from local files: GSM8K, MATH and DeepScaleR rows, as JSONL or Parquet.

Every row is normalized to {"id", "question", "answer"} where answer is the gold final answer as
LaTeX (what goes inside \\boxed{}). Formats, recognised by their fields:
- GSM8K: question, answer = worked solution ending in "#### 72".
- MATH (Hendrycks): problem, solution with the final answer in \\boxed{...} (answer field optional).
- DeepScaleR / already normalized: problem or question, answer = the final answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if absent."""
    for marker in ("\\boxed{", "\\fbox{"):
        start = text.rfind(marker)
        if start < 0:
            continue
        i = start + len(marker)
        depth = 1
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i:j]
        return None
    return None


def normalize(row: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One row of any supported format as {"id", "question", "answer"}."""
    question = row.get("question", row.get("problem"))
    if not isinstance(question, str) or not question.strip():
        raise AstraflowError(
            f"math row {index} has no question/problem text", hint="rows need question or problem fields"
        )
    answer: Any = row.get("answer")
    if isinstance(answer, str) and "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if answer in (None, "") and isinstance(row.get("solution"), str):
        answer = last_boxed(row["solution"])
    if answer in (None, ""):
        raise AstraflowError(
            f"math row {index} has no final answer",
            hint="GSM8K answers end in '#### N'; MATH solutions hold \\boxed{...}; else give an answer field",
        )
    return {
        "id": str(row.get("id", row.get("unique_id", index))),
        "question": question,
        "answer": str(answer),
    }


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Raw rows of a .jsonl / .json (list) / .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise AstraflowError(f"math data file not found: {path}", hint="data_file must name a local file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise AstraflowError("reading parquet needs pyarrow", hint="pip install 'astraflow[math]'") from e
        return list(pq.read_table(path).to_pylist())
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise AstraflowError(f"{path}: a .json data file must hold a list of rows")
        return data
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise AstraflowError(f"{path}:{n}: not JSON ({e.msg})") from e
    return rows


def load_math(path: Path) -> list[dict[str, Any]]:
    """Every row of `path`, normalized."""
    rows = [normalize(r, i) for i, r in enumerate(read_rows(path))]
    if not rows:
        raise AstraflowError(f"math data file {path} has no rows")
    return rows


def generate_arithmetic(seed: int, size: int, max_operand: int = 9) -> Iterator[dict[str, Any]]:
    """Small arithmetic problems in GSM8K format (the smoke dataset), the same for the same seed."""
    rng = random.Random(seed)
    for i in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b
        yield {
            "id": f"arith-{i}",
            "question": f"What is {a} {op} {b}?",
            "answer": f"{a} {op} {b} = {value}\n#### {value}",
        }
