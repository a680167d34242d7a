"""astraflow.state."""
