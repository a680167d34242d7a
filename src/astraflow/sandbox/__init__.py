"""astraflow.sandbox."""
