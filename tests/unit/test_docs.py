"""Docs reflect main: the recipe reference is generated from the models, messages are all documented."""

from __future__ import annotations

from pathlib import Path

import msgspec

from astraflow.config.reference import render_reference
from astraflow.protocol import messages

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_reference_is_current() -> None:
    text = (ROOT / "docs/recipes.md").read_text()
    a, b = "<!-- reference:start -->", "<!-- reference:end -->"
    current = text[text.index(a) + len(a) : text.index(b)].strip()
    assert current == render_reference().strip(), (
        "run: python -m astraflow.config.reference and paste into docs/recipes.md"
    )


def test_every_message_is_documented() -> None:
    text = (ROOT / "docs/protocol.md").read_text()
    names = [
        n
        for n, obj in vars(messages).items()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == messages.__name__
        and n != "Msg"
    ]
    missing = [n for n in names if f"`{n}`" not in text]
    assert missing == []
