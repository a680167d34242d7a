"""Metrics after they are recorded: the metrics.jsonl reader, metric sinks, export and plots."""
