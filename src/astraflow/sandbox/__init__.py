"""astraflow.sandbox: run model-written programs under a dedicated uid, bubblewrap and rlimits.

See docs/sandbox.md for what it isolates and what it does not.
"""

from __future__ import annotations

from astraflow.sandbox.config import SandboxConfig, SandboxLimits
from astraflow.sandbox.pool import SandboxError, SandboxPool, SandboxResult

__all__ = ["SandboxConfig", "SandboxError", "SandboxLimits", "SandboxPool", "SandboxResult"]
