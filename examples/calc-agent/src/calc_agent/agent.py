"""The agent, written against the plain `openai` client as for any OpenAI-compatible server.

It offers the calculator's tools, runs each tool call the model makes and sends the result back as a
`tool` message, and returns the reward of the model's final answer with what it saw as info.
"""

from __future__ import annotations

from typing import Any

import openai

from calc_agent.game import SYSTEM, TOOLS, problem, run_tool, score

MAX_TURNS = 3
"""Model calls per episode: tool rounds, then the answer."""


def agent(endpoint: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One episode: question, tool calls answered by the calculator, final answer; reward and info."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    p = problem(task)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["question"]}]
    calls, first_tool, text = 0, "", None
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            text = message.content
            break
        messages.append(message)
        for call in message.tool_calls:
            calls += 1
            first_tool = first_tool or call.function.name
            result = run_tool(task, call.function.name)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result}
            )
    return {
        "reward": score(task, text),
        "tool_calls": calls,
        "right_tool": first_tool == p["op"],
    }
