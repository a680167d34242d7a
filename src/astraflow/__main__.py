"""`python -m astraflow` is the same as the `astraflow` command."""

from __future__ import annotations

from astraflow.cli.main import main

main()
