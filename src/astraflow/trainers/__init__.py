"""astraflow.trainers."""
