"""Options of the code sandbox: which isolation backend, which uids, and the per-run limits."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SandboxLimits(BaseModel):
    """Resource limits of one run; every limit applies to the whole run, children included."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    wall_s: float = Field(10.0, gt=0)
    """Wall-clock seconds before every process of the run is killed."""
    cpu_s: int = Field(10, ge=1)
    """CPU seconds per process (RLIMIT_CPU); the process gets SIGXCPU, then SIGKILL a second later."""
    memory_mb: int = Field(1024, ge=32)
    """Address space per process in MiB (RLIMIT_AS); an allocation beyond it fails (MemoryError)."""
    processes: int = Field(32, ge=4)
    """Processes of the run's uid at once (RLIMIT_NPROC), the sandbox's own two or three included."""
    file_mb: int = Field(16, ge=1)
    """Largest file the run may write, in MiB (RLIMIT_FSIZE)."""
    open_files: int = Field(64, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = Field(1 << 20, ge=1024)
    """Bytes kept of stdout and of stderr each; a run that writes more is killed ("output_limit")."""
    tmp_mb: int = Field(64, ge=1)
    """Size of the private /tmp (bubblewrap backend only; a tmpfs, so it is memory)."""


class SandboxConfig(BaseModel):
    """How model-written programs are isolated (recipe: workflow.options.sandbox where a workflow uses it)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    backend: Literal["auto", "bwrap", "rlimit"] = "auto"
    """bwrap: bubblewrap namespaces + rlimits; rlimit: rlimits and a separate uid only (weaker: no
    network or filesystem isolation); auto: bwrap when it is installed and works, else rlimit."""
    base_uid: int = Field(1_610_000, ge=1000)
    """First of the dedicated uids: a pool holds a block of 1024 (base_uid + 1024 * block + slot, one
    block per pool on the machine, claimed by a lock file). Used only when running as root; they must
    have no passwd entry, so no real account is ever signalled or confused."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Runs at once in one pool; further runs wait for a free slot."""
    python: str = ""
    """Interpreter that runs programs ("" = /usr/bin/python3 if present, else this interpreter)."""
    limits: SandboxLimits = SandboxLimits()
    """Default limits of every run (a call may pass its own)."""
