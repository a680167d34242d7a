"""astraflow.data."""
