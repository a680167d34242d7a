"""Supervised fine-tuning warm start (`astraflow sft`): a local model trained on a local JSONL, loss on
completion tokens only, written as a model directory a recipe's `policy.model` then names.

Rows are either {"prompt": str, "completion": str} (raw text: the prompt tokenized as the raw-mode
workflows tokenize it, the completion after it, then <eos>) or {"messages": [...], "tools"?: [...]}
(the tokenizer's chat template, given `tools=`; every assistant message is trained, its tool calls
included, rendered as the multi-turn Transcript renders it: each template delta tokenized on its own;
everything else, tool results included, is context). Messages are OpenAI chat messages: `role`,
`content` (a string, or null on an assistant message with `tool_calls`), `tool_calls` on assistant
messages (`{"id"?, "type": "function", "function": {"name", "arguments": JSON string or object}}`),
`tool_call_id` / `name` on tool messages.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("sft")


class SFTError(AstraflowError):
    """Bad SFT input: a missing model or data file, a malformed row, an unusable chat template."""


@dataclass
class Example:
    """One tokenized row: ids and which of them are trained (1) or context (0)."""

    ids: list[int]
    mask: list[int]


@dataclass
class SFTReport:
    """What one SFT run did, also written to OUT/sft.json."""

    examples: int
    trained_tokens: int
    epochs: int
    steps: int
    epoch_loss: list[float] = field(default_factory=list)
    epoch_token_accuracy: list[float] = field(default_factory=list)
    seconds: float = 0.0


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSONL rows of an SFT file, each checked to be prompt/completion or messages."""
    if not path.is_file():
        raise SFTError(f"SFT data file not found: {path}", hint="pass a JSONL file on this machine")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SFTError(f"{path}:{n}: not valid JSON: {exc}", hint="one JSON object per line") from None
        problem = _row_problem(row)
        if problem:
            raise SFTError(
                f"{path}:{n}: {problem}",
                hint='e.g. {"prompt": "Q: 1 + 1?\\nA: ", "completion": "2"} or {"messages": [...], "tools": [...]}',
            )
        rows.append(row)
    if not rows:
        raise SFTError(f"{path} holds no rows", hint="one JSON object per line")
    return rows


def _row_problem(row: Any) -> str:
    """What is wrong with one row ("" when nothing)."""
    if not isinstance(row, dict):
        return "expected a JSON object"
    if "messages" not in row:
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            return ""
        return "expected {'prompt', 'completion'} strings or 'messages' with an assistant turn"
    msgs = row["messages"]
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
    ):
        return "'messages' must be a list of objects with a 'role'"
    if not any(m["role"] == "assistant" for m in msgs):
        return "'messages' has no assistant turn to train"
    for i, m in enumerate(msgs):
        calls = m.get("tool_calls")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and calls and m["role"] == "assistant")):
            return f"message {i}: 'content' must be a string (null only beside assistant tool_calls)"
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                return f"message {i}: 'tool_calls' must be a list, on assistant messages only"
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not (
                    isinstance(fn, dict)
                    and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments", {}), str | dict)
                ):
                    return f"message {i}: each tool call needs function {{name, arguments}}"
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)
    ):
        return "'tools' must be a list of {type: 'function', function: {name, ...}}"
    return ""


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the form chat templates expect (transformers' convention): tool-call arguments as
    objects (a JSON string is parsed), each call with a type and an id."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c["function"]
                args: Any = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args else {}
                        args = parsed if isinstance(parsed, dict) else args
                    except ValueError:
                        pass  # not JSON: the template gets the string
                calls.append(
                    {
                        "id": str(c.get("id") or f"call_{i}_{j}"),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                )
            m["tool_calls"] = calls
        out.append(m)
    return out


def encode_row(tokenizer: Any, row: dict[str, Any], max_length: int) -> Example:
    """Token ids and loss mask of one row (truncated to max_length)."""
    if "messages" in row:
        ex = _encode_chat(tokenizer, chat_messages(row["messages"]), row.get("tools") or None)
    else:
        prompt = list(tokenizer.encode(row["prompt"], add_special_tokens=True))
        completion = list(tokenizer.encode(row["completion"], add_special_tokens=False))
        if tokenizer.eos_token_id is not None:
            completion.append(int(tokenizer.eos_token_id))
        ex = Example(prompt + completion, [0] * len(prompt) + [1] * len(completion))
    return Example(ex.ids[:max_length], ex.mask[:max_length])


def _encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> Example:
    """Each template delta tokenized alone, as Transcript does; assistant turns trained up to and
    including their last <eos> (what follows it in the delta, e.g. a newline, is context, as in a
    rollout where the policy stops at <eos> and the template adds the rest)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTError("the model's tokenizer has no chat template", hint="use prompt/completion rows")
    ids: list[int] = []
    mask: list[int] = []
    text = ""
    eos = tokenizer.eos_token_id

    def extend(rendered: str, trained: bool) -> None:
        nonlocal text
        if not rendered.startswith(text):
            raise SFTError(
                "the chat template rewrites earlier turns when a message is added",
                hint="use prompt/completion rows with this tokenizer",
            )
        new = list(tokenizer.encode(rendered[len(text) :], add_special_tokens=False))
        end = len(new)
        if trained and eos is not None and eos in new:
            end = len(new) - new[::-1].index(eos)
        ids.extend(new)
        mask.extend([1 if trained and k < end else 0 for k in range(len(new))])
        text = rendered

    kw: dict[str, Any] = {"tools": tools} if tools else {}

    def render(msgs: list[dict[str, Any]], gen: bool) -> str:
        try:
            out = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
        except Exception as exc:  # the template's own error (e.g. jinja's raise_exception)
            raise SFTError(f"the model's chat template cannot render this row: {exc}") from None
        return str(out)

    if tools and render(messages, False) == str(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ):
        raise SFTError(
            "the model's chat template does not render tools",
            hint="use a template that does (`astraflow model init --tokenizer bpe` writes one)",
        )
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            extend(render(messages[:i], True), False)
            extend(render(messages[: i + 1], False), True)
    return Example(ids, mask)


def run_sft(
    model_dir: Path,
    data: Path,
    out: Path,
    *,
    epochs: int = 3,
    lr: float = 1e-3,
    batch_size: int = 16,
    max_length: int = 512,
    seed: int = 0,
    threads: int = 1,
    until_loss: float = 0.0,
    device: str = "auto",
) -> SFTReport:
    """Train model_dir on data for `epochs` (AdamW, loss on trained tokens) and write OUT.

    until_loss > 0 stops after the first epoch whose mean loss is at most that (`epochs` is then a cap).
    device: cpu, cuda, cuda:N or auto (a GPU when one is visible).
    """
    if not (model_dir / "config.json").is_file():
        raise SFTError(f"no model directory at {model_dir}", hint="astraflow model init --out DIR makes one")
    if out.exists() and any(out.iterdir()):
        raise SFTError(f"{out} exists and is not empty", hint="choose a new --out directory")
    rows = read_rows(data)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.engines.device import resolve_device

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    dev = torch.device(resolve_device(device))
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.to(dev)
    examples = [encode_row(tok, r, max_length) for r in rows]
    examples = [e for e in examples if sum(e.mask[1:]) > 0]
    if not examples:
        raise SFTError("no row has a completion token to train on", hint="check max_length and the rows")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    report = SFTReport(len(examples), sum(sum(e.mask) for e in examples), epochs, 0)
    t0 = time.monotonic()
    model.train()
    for epoch in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        loss_sum, right, count = 0.0, 0, 0
        for start in range(0, len(order), batch_size):
            batch = [examples[i] for i in order[start : start + batch_size]]
            width = max(len(e.ids) for e in batch)
            ids = torch.tensor([e.ids + [pad] * (width - len(e.ids)) for e in batch], device=dev)
            mask = torch.tensor([e.mask + [0] * (width - len(e.mask)) for e in batch], device=dev)
            attn = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in batch], device=dev)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            target, trained = ids[:, 1:], mask[:, 1:].bool()
            nll = torch.nn.functional.cross_entropy(logits[trained], target[trained], reduction="sum")
            n = int(trained.sum())
            opt.zero_grad()
            (nll / n).backward()
            opt.step()
            report.steps += 1
            loss_sum += float(nll.detach())
            count += n
            right += int((logits[trained].argmax(-1) == target[trained]).sum())
        report.epoch_loss.append(loss_sum / count)
        report.epoch_token_accuracy.append(right / count)
        _log.info(
            "epoch %d/%d: loss %.4f, token accuracy %.3f", epoch + 1, epochs, loss_sum / count, right / count
        )
        if not math.isfinite(loss_sum):
            raise SFTError("the loss is not finite", hint="lower --lr")
        if loss_sum / count <= until_loss:
            break
    report.seconds = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "sft.json").write_text(
        json.dumps(
            {
                "base_model": str(model_dir),
                "data": str(data),
                "lr": lr,
                "until_loss": until_loss,
                **report.__dict__,
            },
            indent=1,
        )
    )
    return report
