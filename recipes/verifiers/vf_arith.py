"""A small local verifiers environment (classic API) for the verifiers workflow's smoke run and tests.

Two turns per episode: the model answers an addition question, the environment asks for the final
number, the model answers again; the rubric scores the last number of the final answer. Environments
from the verifiers hub plug in the same way (install their package and name its env_id).
"""

from __future__ import annotations

import random
import re
from typing import Any

import verifiers as vf
from datasets import Dataset


class TwoTurnArith(vf.MultiTurnEnv):
    """Ask, then ask once more for the final number."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        """The second turn's question."""
        return [{"role": "user", "content": "Final answer, a number only:"}]


def correct(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 when the last number of the model's last message is the answer."""
    last = completion[-1]["content"] if isinstance(completion, list) and completion else str(completion)
    numbers = re.findall(r"-?\d+", str(last))
    return float(bool(numbers) and numbers[-1] == answer)


def load_environment(num_examples: int = 64, seed: int = 0) -> vf.Environment:
    """Addition questions with one-digit operands."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return TwoTurnArith(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[correct]), max_turns=2)
