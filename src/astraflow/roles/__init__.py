"""astraflow.roles."""
