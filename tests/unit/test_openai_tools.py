"""The OpenAI endpoint's tool-call parser, message canonical form, template check and stream pieces,
on a real byte-level BPE tokenizer (no model)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path
from typing import Any

import pytest

from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.workflows.common.loopback_http import HttpError
from astraflow.workflows.openai.stream import text_pieces
from astraflow.workflows.openai.tool_calls import (
    api_message,
    check_template,
    check_tools,
    forced_prefix,
    parse_tool_calls,
    template_message,
)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
OLD_TEMPLATE = (  # the template BPE models were built with before tools: it ignores them
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    corpus = tmp_path_factory.mktemp("tok") / "c.txt"
    corpus.write_text('héllo wörld, the answer is 4 ✓\n<tool_call>{"name": "add"}</tool_call>\n' * 5)
    return build_bpe_tokenizer(Path(corpus), 300)


def test_tool_call_blocks_parse_and_anything_else_stays_content() -> None:
    content, calls = parse_tool_calls(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 2}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert parse_tool_calls('<tool_call>{"name": "add"}</tool_call>')[0] is None
    for bad in (
        "no call here",
        '<tool_call>{"name": "add", "arguments": {"a": 2}</tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add"}</tool_call> <tool_call>{"name": "add"',  # one unclosed
    ):
        assert parse_tool_calls(bad) == (bad, []), bad


def test_a_returned_message_sent_back_compares_equal() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    ours = api_message({"role": "assistant", "content": None, "tool_calls": calls})
    # what the openai client sends back for the parsed message object (extra fields, None content)
    back = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{**calls[0], "function": dict(calls[0]["function"])}],
    }
    assert api_message(back) == ours
    assert template_message(ours)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    tool = api_message(
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": [{"type": "text", "text": "2"}]}
    )
    assert tool == {"role": "tool", "content": "2", "tool_call_id": calls[0]["id"]}
    with pytest.raises(HttpError, match="tool_calls"):
        api_message({"role": "user", "content": "x", "tool_calls": calls})
    with pytest.raises(HttpError, match="function"):
        api_message({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 3}}]})


def test_tool_options_and_a_template_that_ignores_tools_are_refused(tok: Any) -> None:
    assert check_tools({"tools": TOOLS}) == (TOOLS, True)
    assert check_tools({"tools": TOOLS, "tool_choice": "none"}) == (TOOLS, False)
    assert check_tools({}) == (None, False)
    # required and named functions: the forced opening of the call
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    assert check_tools(named) == (TOOLS, True)
    assert forced_prefix(named, TOOLS) == '<tool_call>{"name": "add", "arguments": '
    assert forced_prefix({"tool_choice": "required"}, TOOLS) == '<tool_call>{"name": "'
    assert forced_prefix({"tool_choice": "auto"}, TOOLS) == ""
    for body, why in (
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "not among"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
        ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools must be"),
    ):
        with pytest.raises(HttpError, match=why):
            check_tools(body)
    msgs = [{"role": "user", "content": "2+2?"}]
    called = [
        *msgs,
        template_message(
            api_message(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}
                    ],
                }
            )
        ),
    ]
    check_template(tok, msgs, TOOLS)  # the template built by `model init` renders both
    check_template(tok, called, None)
    saved = tok.chat_template
    try:
        tok.chat_template = OLD_TEMPLATE
        with pytest.raises(HttpError, match="does not render tools"):
            check_template(tok, msgs, TOOLS)
        with pytest.raises(HttpError, match="does not render assistant tool_calls"):
            check_template(tok, called, None)
        tok.chat_template = "{{ raise_exception('tools must come first') }}"
        with pytest.raises(HttpError, match="cannot render these messages: tools must come first"):
            check_template(tok, msgs, TOOLS)
    finally:
        tok.chat_template = saved


def test_stream_pieces_concatenate_to_the_text_one_per_token(tok: Any) -> None:
    text = "héllo wörld → ✓ 42"  # "→" is in no merge: three byte tokens
    ids = tok.encode(text, add_special_tokens=False)
    pieces = text_pieces(tok, ids, text, skip_special=False)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    arrow = pieces.index("→")  # the character comes whole, with the token of its last byte
    assert pieces[arrow - 2 : arrow] == ["", ""]
    # a stop string cut the text short of what the tokens decode to: the pieces still give the text
    cut = text[:7]
    assert "".join(text_pieces(tok, ids, cut, skip_special=False)) == cut
    # the eos token adds no text
    eos = [*ids, tok.eos_token_id]
    assert "".join(text_pieces(tok, eos, text, skip_special=True)) == text
