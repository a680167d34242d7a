"""astraflow.config."""
