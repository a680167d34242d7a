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
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import zmq  # noqa: E402


def _collect_context_without_blocking(self: zmq.Context) -> None:  # type: ignore[type-arg]
    """A context some test dropped unterminated is closed without blocking the collector: pyzmq's own
    __del__ closes its sockets with their linger (infinite by default) and can block in term(), which
    hung an unrelated test that happened to trigger the garbage collection. Its sockets get LINGER 0 and
    the context's term() runs on a daemon thread: term() still waits for any socket a live thread holds
    (it hung the suite's main thread inside an import once), and that wait must not be the test's."""
    if getattr(self, "_shadow", False) or self.closed:
        return
    for sock in list(getattr(self, "_sockets", ()) or ()):
        try:
            sock.setsockopt(zmq.LINGER, 0)
        except Exception:
            pass
    threading.Thread(target=_term_quietly, args=(self,), name="zmq-context-collector", daemon=True).start()


def _term_quietly(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    try:
        ctx.term()
    except Exception:
        pass


zmq.Context.__del__ = _collect_context_without_blocking  # type: ignore[method-assign]

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests.process_leaks"]
"""After each test, the processes it left running are killed and reported (tests/process_leaks.py)."""


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


def install_isolated(package: Path, tmp: Path) -> Path:
    """pip-install a copy of `package` into a folder of `tmp` (never into the running environment) and
    put that folder first on this process's sys.path and on PYTHONPATH for the processes it starts;
    `uninstall_isolated` undoes both. Returns the folder."""
    import importlib
    import shutil

    src = tmp / package.name
    shutil.copytree(package, src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    site = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run(
        [*cmd, "--target", str(site), str(src)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(site) if not old else f"{site}{os.pathsep}{old}"
    importlib.invalidate_caches()
    return site


def uninstall_isolated(site: Path) -> None:
    """Take a folder made by `install_isolated` off sys.path and PYTHONPATH."""
    import importlib

    if str(site) in sys.path:
        sys.path.remove(str(site))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(site)]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)
    importlib.invalidate_caches()
