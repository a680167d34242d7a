"""Benchmarks a user runs on their own machine or cluster (`astraflow bench ...`)."""
