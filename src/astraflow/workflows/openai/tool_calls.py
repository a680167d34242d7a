"""Tool calling for the OpenAI-compatible endpoint: request messages, the chat template, and the one
tool-call format parsed out of generated text.

`tool_choice` "required" or a named function forces the start of the answer (`forced_prefix`): the
engine is prompted with that text's tokens after the assistant header (`forced_ids`: only tokens the
following text cannot re-tokenize, so a trailing space is left to the policy), and they are context in
the trajectory (mask 0), not trained; the rest of the call is sampled freely (no grammar), so an
answer that does not complete a parseable call is returned as content.

The parsed format (Hermes / Qwen style): a tool call is a block

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

with any whitespace around the JSON. Every block of a completion must parse (a JSON object with a
string `name` and an object `arguments`, or no `arguments`: `{}`) for the completion to be returned
as `tool_calls`; otherwise the whole text stays `content`. The text outside the blocks (stripped) is
the message's `content` (None when empty). Only a completion that ended at a stop token is parsed: a
truncated one stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from astraflow.workflows.common.loopback_http import HttpError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""One tool-call block of generated text."""


def _text(content: Any) -> str:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise HttpError(400, "only text content parts are supported")
        return "".join(str(p.get("text", "")) for p in content)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise HttpError(400, "message content must be a string or a list of text parts")
    return content


def _tool_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(fn, dict)
        or call.get("type", "function") != "function"
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments", ""), str)
    ):
        raise HttpError(
            400, "each tool_calls entry needs type 'function' and function {name: str, arguments: str}"
        )
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn.get("arguments", "")},
    }


def api_message(message: Any) -> dict[str, Any]:
    """A request message in one canonical form (role, text content, tool_calls, tool_call_id, name),
    so that a message the endpoint returned compares equal when the agent sends it back."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise HttpError(400, "each message needs a role and a content")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise HttpError(400, "tool_calls must be a list, on assistant messages only")
        out["tool_calls"] = [_tool_call(c) for c in calls]
    if message["role"] == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """The form chat templates expect (transformers' convention): tool-call arguments as a dict."""
    out = dict(message)
    if "tool_calls" in out:
        calls = []
        for c in out["tool_calls"]:
            args: Any = c["function"]["arguments"]
            try:
                parsed = json.loads(args) if args else {}
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass  # not JSON: the template gets the string as sent
            calls.append(
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": args},
                }
            )
        out["tool_calls"] = calls
    return out


def check_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """The request's tools (None: none) and whether to parse tool calls out of the completion."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise HttpError(400, "tool_choice names a tool but the request has no tools")
        return None, False
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise HttpError(400, "tools must be a list of {type: 'function', function: {name, ...}}")
    forced_prefix(body, tools)  # refuses a malformed choice or an unknown tool name
    if body.get("parallel_tool_calls") is False:
        raise HttpError(400, "parallel_tool_calls=false is not supported: every parsed call is returned")
    return tools, choice != "none"


TOOL_CALL_OPEN = '<tool_call>{"name": '
"""The start of every tool-call block as the parsed format (and the tokenizer of `model init`) write it."""


def forced_prefix(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    """The text the policy's answer is forced to start with for the request's tool_choice ("" for
    none / auto): "required" forces the opening of a tool-call block up to the name's opening quote,
    a named function the block up to `"arguments": `. The rest is sampled freely (no grammar)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return ""
    names = [t["function"]["name"] for t in tools or []]
    if choice == "required":
        return TOOL_CALL_OPEN + '"'
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HttpError(
            400, "tool_choice must be 'none', 'auto', 'required' or {type: 'function', function: {name}}"
        )
    if fn["name"] not in names:
        raise HttpError(
            400, f"tool_choice names {fn['name']!r}, which is not among the request's tools {names}"
        )
    return TOOL_CALL_OPEN + json.dumps(fn["name"]) + ', "arguments": '


_PROBES = ("{", "[", '"', " ", "a", "Z", "0", "}", "_", "\n")
"""Texts that may follow a forced prefix: the tokens no probe changes are safe to force."""


def forced_ids(tokenizer: Any, prefix: str) -> list[int]:
    """The tokens of `prefix` that whatever follows cannot re-tokenize: a token at the end (e.g. a
    trailing space that merges with the next character) is left for the policy to sample, so the
    forced ids are the ones the tokenizer would give the whole call text."""
    ids = list(tokenizer.encode(prefix, add_special_tokens=False))
    keep = len(ids)
    for probe in _PROBES:
        other = list(tokenizer.encode(prefix + probe, add_special_tokens=False))
        k = 0
        while k < min(keep, len(other)) and ids[k] == other[k]:
            k += 1
        keep = k
    return ids[:keep]


def check_template(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    """Refuse tools or tool calls the model's chat template would silently drop."""

    def render(msgs: list[dict[str, Any]], with_tools: bool) -> str:
        kw: dict[str, Any] = {"tools": tools} if with_tools else {}
        try:
            return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw))
        except Exception as exc:  # the template's own error (e.g. jinja's raise_exception): the agent's input
            raise HttpError(400, f"the model's chat template cannot render these messages: {exc}") from exc

    hint = (
        "use a chat template that renders them (the one `astraflow model init --tokenizer bpe` writes "
        "does), or describe the tools in the prompt"
    )
    if tools and render(messages, True) == render(messages, False):
        raise HttpError(400, f"the model's chat template does not render tools; {hint}")
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            bare = [*messages[:i], {k: v for k, v in m.items() if k != "tool_calls"}]
            if render([*messages[:i], m], False) == render(bare, False):
                raise HttpError(
                    400, f"the model's chat template does not render assistant tool_calls; {hint}"
                )
            break


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of generated text; no tool calls when a block does not parse."""
    blocks = TOOL_CALL.findall(text)
    if not blocks or text.count("<tool_call>") != len(blocks) or text.count("</tool_call>") != len(blocks):
        return text, []  # none, or an unclosed / stray tag: the text is content
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return text, []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)},
            }
        )
    rest = TOOL_CALL.sub("", text).strip()
    return (rest or None), calls
