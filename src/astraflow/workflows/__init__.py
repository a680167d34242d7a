"""astraflow.workflows."""
