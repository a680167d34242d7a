"""astraflow.tui."""
