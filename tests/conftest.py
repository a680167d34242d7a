"""Shared test setup: offline HF, one torch thread per process, helpers to run the CLI."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite compares against CPU references; on a GPU machine the engine and trainer would pick CUDA.
os.environ.setdefault("ASTRAFLOW_DEVICE", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import zmq  # noqa: E402


def _collect_context_without_blocking(self: zmq.Context) -> None:  # type: ignore[type-arg]
    """A context some test dropped unterminated is destroyed with LINGER 0 when collected: pyzmq's own
    __del__ closes its sockets with their linger (infinite by default) and can block in term(), which
    hung an unrelated test that happened to trigger the garbage collection."""
    if not getattr(self, "_shadow", False) and not self.closed:
        try:
            self.destroy(linger=0)
        except Exception:
            pass


zmq.Context.__del__ = _collect_context_without_blocking  # type: ignore[method-assign]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen3 + tokenizer made by the real `astraflow model init` command."""
    out = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "model",
            "init",
            "--arch",
            "qwen3",
            "--preset",
            "tiny",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out
