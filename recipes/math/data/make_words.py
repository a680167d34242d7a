"""Writes the number-word problems of recipes/math/words-smoke.toml: `python make_words.py` (deterministic).

Each problem is a short question in words ("seven minus two") whose answer is one digit ("5"); the
math workflow's raw prompt is "<question> = \\boxed{" and math-verify checks the boxed digit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "zero one two three four five six seven eight nine".split()
TEMPLATE = "{question} = \\boxed{{"  # the recipe's workflow.options.raw_template


def problems() -> list[tuple[str, int]]:
    """n plus/minus one/two for every one-digit n whose answer is one digit: 34 problems, shuffled."""
    rows: list[tuple[str, int]] = []
    for n in range(10):
        for k in (1, 2):
            if n + k <= 9:
                rows.append((f"{WORDS[n]} plus {WORDS[k]}", n + k))
            if n - k >= 0:
                rows.append((f"{WORDS[n]} minus {WORDS[k]}", n - k))
    random.Random(7).shuffle(rows)
    return rows


def write(here: Path) -> None:
    """Write words-train.jsonl (28), words-heldout.jsonl (6), words-sft.jsonl and words-corpus.txt into `here`."""
    rows = problems()
    held, train = rows[:6], rows[6:]

    def gsm(part: list[tuple[str, int]], prefix: str) -> str:
        return "".join(
            json.dumps({"id": f"{prefix}-{i}", "question": q, "answer": f"#### {a}"}) + "\n"
            for i, (q, a) in enumerate(part)
        )

    (here / "words-train.jsonl").write_text(gsm(train, "words"))
    (here / "words-heldout.jsonl").write_text(gsm(held, "words-heldout"))
    sft = "".join(
        json.dumps({"prompt": TEMPLATE.format(question=q), "completion": f"{a}}}"}) + "\n" for q, a in train
    )
    (here / "words-sft.jsonl").write_text(sft)
    (here / "words-corpus.txt").write_text("".join(TEMPLATE.format(question=q) + f"{a}}}\n" for q, a in rows))


if __name__ == "__main__":
    write(Path(__file__).resolve().parent)
