"""astraflow.engines."""
