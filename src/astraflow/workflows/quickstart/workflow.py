"""The quickstart environment: short digit tasks a random-init tiny model can learn by RL alone.

Tasks: copy ("copy 3 1 4 =" -> "3 1 4"), reverse ("reverse 3 1 4 =" -> "4 1 3") and add
("add 4 7 + 1 5 =" -> "6 2"). The reward is partial credit per answer position plus one position
for stopping right after the answer, so a model is rewarded for every digit it gets right.
Pure Python: the dataset runs in the controller and episodes in a RaaS; neither needs torch here.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.engines.base import Completion
from astraflow.workflows.base import Episode, PolicyClient, Workflow, completion_sequence


class QuickstartConfig(BaseModel):
    """Options of the quickstart workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    task: Literal["copy", "reverse", "add"] = "copy"
    """copy the digits, reverse them, or add two numbers."""
    length: int = Field(2, ge=1, le=32)
    """Digits to copy/reverse, or digits of each addend."""
    size: int = Field(1000, ge=1)
    """Prompts in the generated dataset (used when the recipe's dataset.size is 0)."""
    reward: Literal["partial", "exact"] = "partial"
    """partial: fraction of answer positions (and the final stop) right; exact: 1 only if all are."""


def make_sample(task: str, digits: list[int], length: int) -> tuple[str, str]:
    """The (prompt, answer) of one task instance built from `digits`."""
    if task == "copy":
        return f"copy {' '.join(map(str, digits))} =", " ".join(map(str, digits))
    if task == "reverse":
        return f"reverse {' '.join(map(str, digits))} =", " ".join(map(str, reversed(digits)))
    if task == "add":
        a, b = digits[:length], digits[length:]
        total = int("".join(map(str, a))) + int("".join(map(str, b)))
        return f"add {' '.join(map(str, a))} + {' '.join(map(str, b))} =", " ".join(str(total))
    raise ValueError(f"unknown task {task!r}")


def score(words: list[str], stopped: bool, answer: list[str], exact: bool = False) -> float:
    """Reward of generated `words` (before any stop token) against the `answer` words."""
    right = sum(1 for g, a in zip(words, answer, strict=False) if g == a)
    right += 1 if stopped and len(words) == len(answer) else 0
    total = len(answer) + 1
    if exact:
        return 1.0 if right == total else 0.0
    return right / total


class QuickstartWorkflow(Workflow):
    """Single-turn digit tasks with partial-credit rewards; one role, "actor"."""

    Config = QuickstartConfig
    roles = ("actor",)

    def __init__(self, config: QuickstartConfig | None = None) -> None:
        super().__init__(config if config is not None else QuickstartConfig())
        self.config: QuickstartConfig

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """`size` (or config.size) random task instances, the same for the same seed."""
        cfg = self.config
        rng = random.Random(seed)
        n_digits = cfg.length * (2 if cfg.task == "add" else 1)
        for i in range(size or cfg.size):
            digits = [rng.randrange(10) for _ in range(n_digits)]
            prompt, answer = make_sample(cfg.task, digits, cfg.length)
            yield {"id": f"{cfg.task}-{i}", "prompt": prompt, "answer": answer}

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Ask the actor once, score its answer, return one sequence."""
        actor = policies["actor"]
        prompt_ids = list(actor.tokenizer.encode(sample["prompt"]))
        completion = (await actor.generate(prompt_ids, n=1))[0]
        return self._episode(sample, actor, prompt_ids, completion, {})

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """The task's group: the prompt encoded once and sampled in one n-sample call (the engine
        prefills it once), each completion scored like run_episode's."""
        if type(self).run_episode is not QuickstartWorkflow.run_episode:
            # a subclass that changes the episode keeps its own run_episode per sample
            return await super().run_group(sample, policies, group_sizes)
        actor = policies["actor"]
        n = max(group_sizes.values(), default=1)
        prompt_ids = list(actor.tokenizer.encode(sample["prompt"]))
        completions = await actor.generate(prompt_ids, n=n)
        words: dict[tuple[int, ...], list[str]] = {}
        return [self._episode(sample, actor, prompt_ids, c, words) for c in completions]

    def _episode(
        self,
        sample: dict[str, Any],
        actor: PolicyClient,
        prompt_ids: list[int],
        completion: Completion,
        words_of: dict[tuple[int, ...], list[str]],
    ) -> Episode:
        """Score one completion; `words_of` caches decoded answers (a group repeats many)."""
        tok = actor.tokenizer
        generated = list(completion.token_ids)
        eos = tok.eos_token_id
        stopped = eos is not None and eos in generated
        answer_ids = tuple(generated[: generated.index(eos)] if stopped else generated)
        if answer_ids not in words_of:
            words_of[answer_ids] = tok.decode(list(answer_ids), skip_special_tokens=True).split()
        words = words_of[answer_ids]
        answer = str(sample["answer"]).split()
        reward = score(words, stopped, answer, exact=self.config.reward == "exact")
        seq = completion_sequence(actor, prompt_ids, completion, reward=reward, role="actor")
        correct = 1.0 if stopped and words == answer else 0.0
        return Episode(sequences=[seq], info={"correct": correct, "gen_tokens": float(len(generated))})
