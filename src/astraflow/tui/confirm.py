"""A yes/no question over the dashboard, asked before a destructive control (drain, stop)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class Confirm(ModalScreen[bool]):
    """Shows a question; `y` answers True, `n` or Escape False."""

    CSS = """
    Confirm { align: center middle; }
    #confirm-box { width: 64; height: auto; border: thick $warning; padding: 1 2; background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        """The question and the keys that answer it."""
        with Vertical(id="confirm-box"):
            yield Static(self.question, id="confirm-question")
            yield Static("[b]y[/b] yes    [b]n[/b] / Esc no")

    def action_answer(self, yes: bool) -> None:
        """Close with the answer."""
        self.dismiss(yes)
