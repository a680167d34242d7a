"""Environments behind an HTTP server (reset / step / reward) and a reference server (`env_server`)."""
