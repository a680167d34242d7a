"""astraflow.weights."""
