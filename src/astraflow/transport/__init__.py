"""astraflow.transport."""
