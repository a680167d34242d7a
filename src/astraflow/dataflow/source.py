"""The prompt source: the workflow's generated dataset or a JSONL file, cycled in epochs, resumable.

The cursor (epoch, index) is saved in the store's stage_state (policy "", stage -1), in the same
transaction as the tasks it produced, so a restarted controller continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from astraflow.config.recipe import Recipe
from astraflow.errors import RecipeError
from astraflow.state.store import Store

CURSOR_POLICY = ""
CURSOR_STAGE = -1


def prompt_key(sample: dict[str, Any]) -> str:
    """A stable key of a prompt: its 'key' or 'id' field, else a hash of its content."""
    for name in ("key", "id"):
        if name in sample and sample[name] not in (None, ""):
            return str(sample[name])
    blob = json.dumps(sample, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Samples of a JSONL file (one JSON object a line; blank lines ignored)."""
    if not path.is_file():
        raise RecipeError(
            f"dataset file not found: {path}", hint="dataset.path must name a JSONL file on this machine"
        )
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{path}:{n}: not valid JSON: {exc}", hint="one JSON object per line") from None
        if not isinstance(obj, dict):
            raise RecipeError(f"{path}:{n}: expected a JSON object", hint="one JSON object per line")
        out.append(obj)
    return out


def workflow_epochs(recipe: Recipe) -> Callable[[int], Iterator[dict[str, Any]]]:
    """epoch -> the samples of that epoch, from dataset.path or the workflow's own dataset()."""
    if recipe.dataset.path:
        rows = read_jsonl(Path(recipe.dataset.path))
        return lambda _epoch: iter(rows)
    from astraflow import plugins

    cls = plugins.load("workflows", recipe.workflow.name)
    workflow = cls(cls.Config.model_validate(recipe.workflow.options))
    seed, size = recipe.run.seed, recipe.dataset.size
    # Every epoch replays the same prompts: curators track prompts by key across epochs.
    return lambda _epoch: iter(workflow.dataset(seed, size))


class PromptSource:
    """An endless, resumable stream of (key, sample)."""

    def __init__(self, epochs: Callable[[int], Iterator[dict[str, Any]]], store: Store | None = None) -> None:
        self._epochs = epochs
        self.store = store
        self.reload()
        if store is not None:
            store.on_rollback.append(self.reload)

    def reload(self) -> None:
        """Take the cursor saved in the store (the start, without one): at start, and after a
        transaction rolled back, so prompts it drew and did not queue are offered again."""
        self.epoch, self.index = 0, 0
        if self.store is not None:
            saved = self.store.load_stage_state(CURSOR_POLICY).get(CURSOR_STAGE)
            if saved is not None:
                self.epoch, self.index = int(saved[1]["epoch"]), int(saved[1]["index"])
        self._it = self._open()

    def _open(self) -> Iterator[dict[str, Any]]:
        it = self._epochs(self.epoch)
        for _ in range(self.index):
            next(it, None)
        return it

    def next(self) -> tuple[str, dict[str, Any]]:
        """The next prompt, starting a new epoch when one ends (an empty source is an error)."""
        sample = next(self._it, None)
        if sample is None:
            if self.index == 0:
                raise RecipeError("the prompt source is empty", hint="check dataset.path / dataset.size")
            self.epoch, self.index = self.epoch + 1, 0
            self._it = self._open()
            sample = next(self._it, None)
            if sample is None:
                raise RecipeError(
                    f"the prompt source is empty in epoch {self.epoch}", hint="check dataset.size"
                )
        self.index += 1
        return prompt_key(sample), dict(sample)

    def save(self) -> None:
        """Persist the cursor (call inside the transaction that queued the produced tasks)."""
        if self.store is not None:
            self.store.save_stage_state(
                CURSOR_POLICY, CURSOR_STAGE, "source", {"epoch": self.epoch, "index": self.index}
            )
