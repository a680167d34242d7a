"""astraflow.losses."""
