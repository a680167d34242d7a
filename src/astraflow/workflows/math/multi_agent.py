"""The `math-multi-agent` workflow: a solver answers, a verifier judges the answer, and a rejected answer
gets one retry that sees the verifier's text. math-verify decides what is correct.

Per task (group sizes are each policy's own, roles "solver" and "verifier"; one policy may play both):
- the solver makes G_s attempts. Each attempt is one multi-turn Sequence: the answer, and when the
  verifier rejected it, the verifier's text (masked) and the retry. Its reward is the final answer's
  correctness (the retry's when there was one), so the G_s sequences of a task, which all start from
  the same prompt, are one group: a retry is only ever compared with attempts at the same problem, and
  a solver that was right is paid for holding to it;
- the verifier judges every attempt G_v times, ending with \\boxed{correct} or \\boxed{incorrect}; the
  G_v verdicts on attempt i are one group (group_key "a<i>": same input); reward 1 when the verdict
  matches math-verify's judgement of the first answer, 0 otherwise (no verdict = 0). The first verdict
  decides whether the attempt is retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from pydantic import ConfigDict

from astraflow.protocol.messages import Scalar, Sequence
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.math.data import last_boxed, normalize
from astraflow.workflows.math.workflow import MathConfig, MathWorkflow
from astraflow.workflows.transcript import PolicyTurn, Transcript

VERIFIER_INSTRUCTION = (
    "Check the proposed solution of the problem. Explain briefly, then end with \\boxed{correct} or "
    "\\boxed{incorrect}."
)
RETRY_TEMPLATE = "A reviewer checked your answer:\n{review}\nTry again. Put the final answer in \\boxed{{}}."
ACCEPT = frozenset({"correct", "right", "yes", "true"})
REJECT = frozenset({"incorrect", "wrong", "no", "false"})


class MathMultiConfig(MathConfig):
    """Options of the math-multi-agent workflow: the math workflow's, and the verifier's and retry's."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    verifier_instruction: str = VERIFIER_INSTRUCTION
    """Chat mode: what the verifier is asked after the problem and the proposed solution."""
    verifier_raw_template: str = "Q: {question}\nA: {answer}\nCorrect? \\boxed{{"
    """Raw mode: the verifier's prompt; ending inside \\boxed{ asks only for the verdict word."""
    retry_template: str = RETRY_TEMPLATE
    """The solver's next message after a rejection; {review} is the verifier's text."""
    raw_retry_template: str = "\nReview: {review}\nA: \\boxed{{"
    """Raw mode: appended after the first answer for the retry."""


def verdict(text: str) -> bool | None:
    """The verifier's verdict: the last \\boxed{} word (correct/incorrect and synonyms), else None."""
    word = (last_boxed(text) or "").strip().lower().strip(".!").replace("\\text{", "").rstrip("}")
    if word in ACCEPT:
        return True
    if word in REJECT:
        return False
    return None


class MathMultiAgentWorkflow(Workflow):
    """Solver + verifier with one retry; see the module docstring."""

    Config = MathMultiConfig
    roles = ("solver", "verifier")

    def __init__(self, config: MathMultiConfig | None = None) -> None:
        super().__init__(config if config is not None else MathMultiConfig())
        self.config: MathMultiConfig
        self._math = MathWorkflow(self.config)  # the data, prompts and verifier pool of `math`

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The math workflow's problems."""
        return self._math.dataset(seed, size)

    @classmethod
    def sequences_per_task(cls, group_sizes: dict[str, int]) -> dict[str, int]:
        """solver: G_s attempts (each with its retry inside); verifier: G_v verdicts per attempt."""
        gs, gv = group_sizes.get("solver", 1), group_sizes.get("verifier", 1)
        return {"solver": gs, "verifier": gs * gv}

    @property
    def _raw(self) -> bool:
        return self.config.prompt == "raw"

    def _answer_text(self, text: str, template: str) -> str:
        # a raw prompt ending inside \boxed{ has the model write only what goes in it
        return "\\boxed{" + text if self._raw and template.rstrip().endswith("\\boxed{{") else text

    def close(self) -> None:
        """Stop the math workflow's verifier processes."""
        self._math.close()

    async def _correct(self, text: str, gold: str) -> float:
        result = await self._math.pool().call(text, gold)
        return float(result.value[0]) if result.ok else 0.0

    async def _verify(
        self, client: PolicyClient, question: str, answer: str
    ) -> tuple[Transcript, PolicyTurn]:
        cfg = self.config
        if self._raw:
            tr = Transcript(client, chat=False)
            tr.add_text(
                cfg.verifier_raw_template.format(question=question, answer=answer), special_tokens=True
            )
        else:
            tr = Transcript(client, chat=True)
            tr.add_message(
                "user", f"Problem:\n{question}\n\nProposed solution:\n{answer}\n\n{cfg.verifier_instruction}"
            )
        return tr, await tr.generate()

    async def _retry(self, tr: Transcript, review: str) -> PolicyTurn:
        cfg = self.config
        if self._raw:
            tr.add_text(cfg.raw_retry_template.format(review=review))
        else:
            tr.add_message("user", cfg.retry_template.format(review=review))
        return await tr.generate()

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """One attempt, one verdict, and its retries (the group form is run_group)."""
        (ep,) = await self.run_group(sample, policies, {"solver": 1, "verifier": 1})
        return ep

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """First attempts, verdicts on each, retries of the rejected ones; one Episode per attempt."""
        cfg = self.config
        row = normalize(sample)
        question, gold = row["question"], row["answer"]
        solver, verifier = policies["solver"], policies["verifier"]
        gs = group_sizes.get("solver", 1)
        # a read-only verifier (frozen, or its budget met) only has to give the retry its text
        gv = 1 if verifier.read_only else group_sizes.get("verifier", 1)

        async def attempt() -> tuple[Transcript, PolicyTurn]:
            tr = self._math._transcript(solver, question)
            return tr, await tr.generate()

        firsts = await asyncio.gather(*(attempt() for _ in range(gs)))
        answers = [self._answer_text(t.text, cfg.raw_template) for _, t in firsts]
        correct = await asyncio.gather(*(self._correct(a, gold) for a in answers))
        verdicts = await asyncio.gather(
            *(asyncio.gather(*(self._verify(verifier, question, a) for _ in range(gv))) for a in answers)
        )

        async def settle(i: int) -> tuple[bool, float]:
            """Retry attempt i if its first verdict is not "correct"; (retried, final correctness)."""
            review = self._answer_text(verdicts[i][0][1].text, cfg.verifier_raw_template)
            if verdict(review) is True:
                return False, correct[i]
            turn = await self._retry(firsts[i][0], review)
            return True, await self._correct(self._answer_text(turn.text, cfg.raw_template), gold)

        settled = await asyncio.gather(*(settle(i) for i in range(gs)))
        episodes = []
        for i, (retried, final) in enumerate(settled):
            seqs: list[Sequence] = [_tag(firsts[i][0].sequence(final), "solver", "")]
            right = 0.0
            for vtr, vturn in verdicts[i]:
                said = verdict(self._answer_text(vturn.text, cfg.verifier_raw_template))
                matched = float(said is not None and said == bool(correct[i]))
                right += matched
                seqs.append(_tag(vtr.sequence(matched), "verifier", f"a{i}"))
            info: dict[str, Scalar] = {
                "correct_first": correct[i],
                "correct_final": final,
                "verifier_accuracy": right / len(verdicts[i]),
                "retried": float(retried),
            }
            episodes.append(Episode(sequences=seqs, info=info))
        return episodes


def _tag(seq: Sequence, role: str, group_key: str) -> Sequence:
    seq.role = role
    seq.group_key = group_key
    return seq
