"""astraflow.dataflow."""
