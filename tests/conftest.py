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
