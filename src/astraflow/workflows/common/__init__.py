"""Pieces several workloads share: tool calls on a thread pool, a loopback HTTP server, a verifier pool."""
