"""Environments of the `verifiers` library, run against the episode endpoint (`verifiers`)."""
