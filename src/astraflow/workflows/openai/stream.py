"""`stream: true` for the OpenAI-compatible endpoint: a finished answer as OpenAI's SSE chunks.

The engine returns whole completions, so a streamed answer is sampled and recorded exactly as a
non-streamed one (same ids, logprobs, versions), then sent as chunks: one per generated token
(its text piece; the pieces concatenate to the answer's text), a final chunk with finish_reason, and
with `stream_options.include_usage` a last chunk of usage. The first token arrives when the whole
completion is done: streaming here is for client compatibility, not latency.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from astraflow.engines.base import Completion


@dataclass
class Answer:
    """One choice of a finished request, as the non-streaming answer returns it."""

    completion: Completion
    """The (stop-cut) completion the engine sampled: what is recorded."""
    text: str
    """The text returned (chat: the message content before tool-call parsing)."""
    message: dict[str, Any] | None
    """Chat: the assistant message returned (content, tool_calls); None for completions."""
    finish_reason: str
    """stop, length or tool_calls."""


def text_pieces(tokenizer: Any, ids: list[int], text: str, *, skip_special: bool) -> list[str]:
    """One text piece per token, concatenating to `text` exactly. Decoded incrementally from the last
    emitted token, so a character split over several byte tokens comes with the token that completes
    it; where the decoded tokens and `text` part (a stop string cut it), the rest comes at the end."""

    def dec(part: list[int]) -> str:
        return str(tokenizer.decode(part, skip_special_tokens=skip_special))

    raw: list[str] = []
    start = done = 0  # window [start, done) was emitted; decoding from `start` keeps spacing context
    for k in range(1, len(ids) + 1):
        before, now = dec(ids[start:done]), dec(ids[start:k])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            raw.append(now[len(before) :])
            start, done = done, k
        else:
            raw.append("")
    out, pos, ok = [], 0, True
    for piece in raw:
        if ok and text.startswith(piece, pos):
            out.append(piece)
            pos += len(piece)
        else:
            ok = False
            out.append("")
    if out:
        out[-1] += text[pos:]
    return out


async def _each(events: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for e in events:
        yield e


def chat_chunks(
    head: dict[str, Any],
    answers: list[Answer],
    tokenizer: Any,
    token_logprobs: Callable[[Completion], list[dict[str, Any]]] | None,
    usage: dict[str, int] | None,
) -> AsyncIterator[dict[str, Any]]:
    """chat.completion.chunk events for `answers` (`head`: id, created, model); usage last if given."""
    base = {**head, "object": "chat.completion.chunk"}
    if usage is not None:
        base["usage"] = None
    events: list[dict[str, Any]] = []

    def chunk(i: int, delta: dict[str, Any], lp: list[dict[str, Any]] | None = None, fin: Any = None) -> None:
        choice = {"index": i, "delta": delta, "logprobs": None if lp is None else {"content": lp}}
        events.append({**base, "choices": [{**choice, "finish_reason": fin}]})

    for i, a in enumerate(answers):
        assert a.message is not None
        c = a.completion
        lps = token_logprobs(c) if token_logprobs else None
        chunk(i, {"role": "assistant", "content": ""})
        calls = a.message.get("tool_calls")
        if calls:
            if a.message.get("content") or lps:
                chunk(i, {"content": a.message.get("content") or ""}, lps)
            for j, call in enumerate(calls):
                chunk(i, {"tool_calls": [{"index": j, **call}]})
        else:
            pieces = text_pieces(tokenizer, list(c.token_ids), a.text, skip_special=False)
            for k, piece in enumerate(pieces):
                chunk(i, {"content": piece}, None if lps is None else lps[k : k + 1])
        chunk(i, {}, fin=a.finish_reason)
    if usage is not None:
        events.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return _each(events)


def completion_chunks(
    head: dict[str, Any],
    answers: list[Answer],
    tokenizer: Any,
    logprobs: bool,
    usage: dict[str, int] | None,
) -> AsyncIterator[dict[str, Any]]:
    """text_completion events for `answers`, one per token, then one with finish_reason per choice."""
    base = {**head, "object": "text_completion"}
    if usage is not None:
        base["usage"] = None
    events: list[dict[str, Any]] = []
    for i, a in enumerate(answers):
        c = a.completion
        pieces = text_pieces(tokenizer, list(c.token_ids), a.text, skip_special=True)
        for k, piece in enumerate(pieces):
            lp = None
            if logprobs:
                lp = {
                    "tokens": [str(tokenizer.decode([c.token_ids[k]]))],
                    "token_logprobs": [float(c.logprobs[k])],
                    "top_logprobs": None,
                    "text_offset": None,
                }
            events.append(
                {**base, "choices": [{"index": i, "text": piece, "logprobs": lp, "finish_reason": None}]}
            )
        events.append(
            {
                **base,
                "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": a.finish_reason}],
            }
        )
    if usage is not None:
        events.append({**head, "object": "text_completion", "choices": [], "usage": usage})
    return _each(events)
