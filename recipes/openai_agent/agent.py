"""An example agent written against the plain `openai` client, as it would be for any OpenAI server.

astraflow hands it an endpoint (base_url + api_key) that serves the policy for this episode only and
records every token the engine generates. Two turns: think, then give the final number.
"""

from __future__ import annotations

import re
from typing import Any

import openai


def agent(endpoint: Any, task: dict[str, Any]) -> str:
    """Ask the question, then ask for the final answer only; returns the last reply."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "Final answer, a number only:"})
    second = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=8)
    return second.choices[0].message.content or ""


def reward(task: dict[str, Any], answer: str) -> float:
    """1.0 when the last number in the answer is the task's (GSM8K-style "#### N" gold answers)."""
    gold = str(task["answer"]).split("####")[-1].strip().replace(",", "")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == gold)
