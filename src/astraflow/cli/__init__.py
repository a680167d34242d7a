"""astraflow.cli."""
