"""The `search` workflow: multi-turn question answering with `search` / `read` tools over a local BM25
index (bm25s) of a corpus the user points at; reward = token F1 (or exact match) with the gold answers.

Each policy turn holds one action, the first tag it writes:
  <search>query</search>   -> the top-k documents' ids, titles and first words (a tool message)
  <read>doc id</read>      -> that document's text, cut at read_chars (a tool message)
  <answer>text</answer>    -> ends the episode
A turn with no tag, or running out of turns or context, ends the episode with reward 0. Built on the
multi-turn toolkit: tool turns are masked, the index runs in the tool thread pool (never on the loop).
"""

from __future__ import annotations

import json
import re
import string
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.tools import Tools
from astraflow.workflows.transcript import Transcript, TranscriptFull

ACTION = re.compile(r"<(search|read|answer)>(.*?)(?:</\1>|$)", re.S)
SYSTEM = (
    "Answer the question. To look things up write <search>query</search> or <read>doc id</read>; "
    "when you know, write <answer>the answer</answer>."
)


class SearchConfig(BaseModel):
    """Options of the search workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    corpus_file: str
    """JSONL of documents: {"id", "title", "text"} per line."""
    questions_file: str = ""
    """JSONL of {"question", "answers": [...]} ("" = the recipe's dataset.path)."""
    top_k: int = Field(3, ge=1)
    """Documents a search returns."""
    read_chars: int = Field(600, ge=50)
    """Characters of a document a read returns."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per episode."""
    max_tokens: int = Field(2048, ge=16)
    """Context budget of the whole conversation."""
    reward: Literal["f1", "em"] = "f1"
    """Token F1 against the best gold answer, or exact match (after normalization)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """A search or read taking longer returns an error to the policy."""


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the usual QA normalization)."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def f1(pred: str, gold: str) -> float:
    """Token F1 of two normalized answers."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if not p or not g or common == 0:
        return float(p == g)
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


class Index:
    """A BM25 index of a JSONL corpus, built once per process."""

    def __init__(self, path: Path) -> None:
        import bm25s

        path = Path(path)
        if not path.is_file():
            raise AstraflowError(
                f"search corpus not found: {path}", hint="corpus_file must be a local JSONL file"
            )
        self.docs = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        if not self.docs:
            raise AstraflowError(f"search corpus {path} is empty")
        self.by_id = {str(d["id"]): d for d in self.docs}
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        texts = [f"{d.get('title', '')} {d['text']}" for d in self.docs]
        self.retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> str:
        """Top-k documents as "[id] title: first words" lines."""
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        k = min(k, len(self.docs))
        idx, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        lines = []
        for i, s in zip(idx[0], scores[0], strict=True):
            if s > 0:
                d = self.docs[int(i)]
                lines.append(f"[{d['id']}] {d.get('title', '')}: {' '.join(d['text'].split()[:12])}")
        return "\n".join(lines) or "no results"

    def read(self, doc_id: str, chars: int) -> str:
        """The text of one document (or an error line)."""
        doc = self.by_id.get(doc_id.strip().strip("[]"))
        return doc["text"][:chars] if doc else f"no document {doc_id.strip()!r}"


class SearchWorkflow(Workflow):
    """Multi-turn search-and-answer over a local BM25 index; one role, "actor"."""

    Config = SearchConfig
    roles = ("actor",)

    def __init__(self, config: SearchConfig) -> None:
        super().__init__(config)
        self.config: SearchConfig
        self._index: Index | None = None
        self._tools: Tools | None = None

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The questions of questions_file (the recipe's dataset.path is read by the controller instead)."""
        if not self.config.questions_file:
            raise AstraflowError(
                "the search workflow needs questions", hint="set dataset.path or questions_file"
            )
        path = Path(self.config.questions_file)
        if not path.is_file():
            raise AstraflowError(f"questions file not found: {path}")
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        yield from rows[:size] if size else rows

    def tools(self) -> Tools:
        """search and read, run in the tool thread pool (the index is built there too, once)."""
        if self._tools is None:
            cfg = self.config

            lock = threading.Lock()

            def index() -> Index:
                with lock:  # tool threads race for the first build
                    if self._index is None:
                        self._index = Index(Path(cfg.corpus_file))
                    return self._index

            self._tools = Tools(
                {
                    "search": lambda q: index().search(q, cfg.top_k),
                    "read": lambda d: index().read(d, cfg.read_chars),
                },
                timeout_s=cfg.tool_timeout_s,
            )
        return self._tools

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Alternate policy turns and tool results until an answer, then score it."""
        cfg = self.config
        answers = [str(a) for a in sample.get("answers", [sample.get("answer", "")])]
        tr = Transcript(policies["actor"], chat=True, max_tokens=cfg.max_tokens)
        tr.add_message("system", SYSTEM)
        tr.add_message("user", str(sample["question"]))
        answer: str | None = None
        calls = 0
        for _ in range(cfg.max_turns):
            try:
                turn = await tr.generate()
            except TranscriptFull:
                break
            match = ACTION.search(turn.text)
            if match is None:
                break
            kind, arg = match.group(1), match.group(2).strip()
            if kind == "answer":
                answer = arg
                break
            calls += 1
            result = await self.tools().call(kind, arg)
            tr.add_message("tool", result.text())
        if answer is None:
            reward = 0.0
        elif cfg.reward == "em":
            reward = float(any(normalize_answer(answer) == normalize_answer(g) for g in answers))
        else:
            reward = max(f1(answer, g) for g in answers)
        info: dict[str, Scalar] = {
            "answered": float(answer is not None),
            "tool_calls": float(calls),
            "turns": float(len(tr.turns)),
        }
        return Episode(sequences=[tr.sequence(reward)], info=info)
