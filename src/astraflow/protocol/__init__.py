"""astraflow.protocol."""
