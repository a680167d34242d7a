"""The search workflow: real bm25s over the shipped corpus, multi-turn transcripts, F1/EM rewards."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from astraflow.engines.base import Completion
from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.protocol.messages import SamplingParams
from astraflow.workflows.search.workflow import Index, SearchConfig, SearchWorkflow, f1

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "recipes/search/data/corpus.jsonl"


def test_bm25_index_finds_and_reads_documents() -> None:
    index = Index(CORPUS)
    hits = index.search("capital of Japan", 3)
    assert hits.splitlines()[0].startswith("[tokyo] Tokyo:")
    assert "Edo" in index.read("tokyo", 600)
    assert index.read("[tokyo]", 20) == index.read("tokyo", 20)
    assert index.read("atlantis", 100).startswith("no document")


def test_f1_and_normalization() -> None:
    assert f1("The Pacific", "Pacific Ocean") == 2 * (1 * 0.5) / 1.5
    assert f1("Tokyo.", "tokyo") == 1.0
    assert f1("", "tokyo") == 0.0


class ScriptedClient:
    """A fake PolicyClient (named so): each call answers with the next scripted turn."""

    policy = "main"

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64)
        self.prompts: list[str] = []

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        ids = list(self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)) + [
            self.tokenizer.eos_token_id
        ]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop", SamplingParams())]


def test_episode_searches_then_answers(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text(CORPUS.read_text())
    tok = build_bpe_tokenizer(tmp_path / "c.txt", 400)
    wf = SearchWorkflow(SearchConfig(corpus_file=str(CORPUS)))
    sample = {"question": "What is the capital of Japan?", "answers": ["Tokyo"]}
    client = ScriptedClient(tok, ["<search>capital of Japan</search>", "<answer>Tokyo</answer>"])
    wrong = ScriptedClient(tok, ["I do not know"])
    try:
        ep = asyncio.run(wf.run_episode(sample, {"actor": client}))
        ep_wrong = asyncio.run(wf.run_episode(sample, {"actor": wrong}))
    finally:
        wf.tools().close()
    seq = ep.sequences[0]
    assert seq.reward == 1.0 and ep.info["tool_calls"] == 1.0 and ep.info["turns"] == 2.0
    # The second turn saw the search result as a tool message; only the two policy turns are trainable.
    assert "<|im_start|>tool\n[tokyo] Tokyo:" in client.prompts[1]
    assert seq.turns is not None and sum(n for _, n, _ in seq.turns) == sum(seq.loss_mask)
    assert ep_wrong.sequences[0].reward == 0.0 and ep_wrong.info["answered"] == 0.0
