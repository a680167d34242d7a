"""The quickstart workload (digits, no downloads) and the toys built on its task: `collab` (two policies)
and `verify` (a tool call). `QuickstartWorkflow`, its config and `score` are what third-party workflows
build on (tests/plugins), so they are importable from here."""

from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow, score

__all__ = ["QuickstartConfig", "QuickstartWorkflow", "score"]
