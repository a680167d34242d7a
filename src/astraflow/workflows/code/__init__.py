"""The code workload: programs checked against tests in the sandbox (`code`, `code-multi-agent`)."""
