"""astraflow: dataflow-oriented reinforcement learning for LLM agents."""

from __future__ import annotations

__version__ = "0.1.0"
