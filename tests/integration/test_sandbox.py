"""The sandbox contains real attacks: each test runs the attack as model-written code would.

Every test would fail with the protection it names removed (no uid drop, no namespace, no rlimit,
no wall-clock kill, no output cap). Both backends run where they can; bubblewrap tests skip when
bwrap is not installed, and the uid-based ones when we are not root (CI runs as root).
"""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from astraflow.sandbox import SandboxConfig, SandboxLimits, SandboxPool, SandboxResult
from astraflow.sandbox.isolation import bwrap_path, processes_of_uid

ROOT = os.geteuid() == 0


def _bwrap_unusable() -> str:
    """Why bubblewrap cannot run here ("" when it can): not installed, or no user namespaces."""
    if bwrap_path() is None:
        return "bubblewrap is not installed"

    async def probe() -> str:
        pool = SandboxPool(SandboxConfig(backend="bwrap", concurrency=1))
        try:
            r = await pool.run("print('ok')")
            return (
                ""
                if r.status == "ok"
                else f"bubblewrap cannot create its namespaces here: {r.stderr[-200:]!r}"
            )
        finally:
            pool.close()

    return asyncio.run(probe())


BWRAP_SKIP = _bwrap_unusable()
BACKENDS = [pytest.param("bwrap", marks=pytest.mark.skipif(bool(BWRAP_SKIP), reason=BWRAP_SKIP)), "rlimit"]
needs_root = pytest.mark.skipif(not ROOT, reason="the dedicated sandbox uid needs root")


def run(backend: str, code: str, **limits: Any) -> SandboxResult:
    """Run `code` once in a fresh pool of `backend` with `limits` over small defaults."""
    lim = SandboxLimits(**{"wall_s": 20.0, "cpu_s": 10, "processes": 16, **limits})

    async def go() -> SandboxResult:
        pool = SandboxPool(SandboxConfig(backend=backend, concurrency=2, limits=lim))  # type: ignore[arg-type]
        try:
            return await pool.run(textwrap.dedent(code))
        finally:
            pool.close()

    return asyncio.run(go())


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_a_program_with_stdin_and_cleared_environment(backend: str) -> None:
    async def go() -> SandboxResult:
        pool = SandboxPool(SandboxConfig(backend=backend))  # type: ignore[arg-type]
        try:
            return await pool.run("import os,sys\nprint(sys.stdin.read()[::-1], os.getuid())", stdin=b"abc")
        finally:
            pool.close()

    r = asyncio.run(go())
    assert r.status == "ok", r.stderr
    assert r.backend == backend
    word, uid = r.stdout.decode().split()
    assert word == "cba"
    if ROOT:
        assert int(uid) == r.uid != 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_hits_the_process_limit(backend: str) -> None:
    # Bounded at 300 forks so that a broken limit fails the test rather than the machine.
    r = run(
        backend,
        """
        import os, time
        n = 0
        for _ in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print("forks", n)
        """,
        processes=16,
    )
    forks = int(r.stdout.split()[1])
    assert forks <= 16
    if ROOT:
        assert processes_of_uid(r.uid) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_gigabyte_allocation_fails(backend: str) -> None:
    r = run(backend, "x = bytearray(10 * 1024**3)\nprint('allocated', len(x))", memory_mb=512)
    assert b"allocated" not in r.stdout
    assert b"MemoryError" in r.stderr
    assert r.status == "error"


@pytest.mark.skipif(bool(BWRAP_SKIP), reason=BWRAP_SKIP)
def test_cannot_connect_to_a_loopback_listener() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = run(
            "bwrap",
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=3).sendall(b"stolen")
                print("CONNECTED")
            except OSError as e:
                print("refused", e)
            """,
        )
        assert b"refused" in r.stdout and b"CONNECTED" not in r.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_environment_secret_is_not_visible(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = "canary-env-7f3a9c"
    monkeypatch.setenv("ASTRAFLOW_TEST_SECRET", canary)
    r = run(
        backend,
        """
        import os
        print(dict(os.environ))
        # Every other process's environment too (ours, the test's, the parent's).
        for pid in os.listdir("/proc"):
            try:
                print(open(f"/proc/{pid}/environ", "rb").read())
            except OSError:
                pass
        """,
    )
    assert r.status == "ok", r.stderr
    assert canary.encode() not in r.stdout + r.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_secret_file_outside_is_not_readable(backend: str, tmp_path: Path) -> None:
    if backend == "rlimit" and not ROOT:
        pytest.skip("the rlimit backend protects files by uid, which needs root")
    canary = "canary-file-51be02"
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    secret = secret_dir / "token"
    secret.write_text(canary)
    if backend == "bwrap":
        # World-readable on purpose: only the mount namespace keeps it out.
        for p in (tmp_path, secret_dir):
            p.chmod(0o755)
        secret.chmod(0o644)
        tmp_path.parent.chmod(0o755)
    else:
        secret.chmod(0o600)
    r = run(
        backend,
        f"""
        try:
            print(open({str(secret)!r}).read())
        except OSError as e:
            print("denied", type(e).__name__)
        """,
    )
    assert canary.encode() not in r.stdout
    assert b"denied" in r.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_loop_is_stopped_by_the_cpu_limit(backend: str) -> None:
    r = run(backend, "while True:\n    pass", cpu_s=1, wall_s=60)
    assert r.status == "killed", (r.status, r.stderr)
    assert r.wall_s < 60


@pytest.mark.parametrize("backend", BACKENDS)
def test_sleeping_program_is_killed_at_the_wall_clock(backend: str) -> None:
    r = run(backend, "import time\nprint('start', flush=True)\ntime.sleep(600)", wall_s=1.5)
    assert r.status == "timeout"
    assert r.stdout == b"start\n"
    assert r.wall_s < 30


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_daemonized_child_does_not_outlive_the_run(backend: str) -> None:
    r = run(
        backend,
        """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                sys.stdout.close()
                sys.stderr.close()
                time.sleep(120)
            os._exit(0)
        os.wait()
        print("parent exits")
        """,
    )
    assert r.status == "ok", r.stderr
    assert processes_of_uid(r.uid) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_flood_is_capped_and_killed(backend: str) -> None:
    r = run(backend, "while True:\n    print('x' * 1000)", output_bytes=4096, wall_s=60)
    assert r.status == "output_limit"
    assert len(r.stdout) == 4096


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_bounds_concurrency_and_isolates_slots(backend: str) -> None:
    async def go() -> tuple[list[SandboxResult], int]:
        pool = SandboxPool(SandboxConfig(backend=backend, concurrency=3))  # type: ignore[arg-type]
        try:
            code = "import os,time\ntime.sleep(0.3)\nprint(os.getuid())"
            results = await asyncio.gather(*(pool.run(code) for _ in range(9)))
            return list(results), pool.peak_busy
        finally:
            pool.close()

    results, peak = asyncio.run(go())
    assert all(r.status == "ok" for r in results)
    assert peak == 3
    if ROOT:
        assert len({r.uid for r in results}) == 3


@needs_root
def test_two_pools_on_one_machine_get_disjoint_uids() -> None:
    a, b = SandboxPool(SandboxConfig(concurrency=2)), SandboxPool(SandboxConfig(concurrency=2))
    try:
        assert {a.slot_uid(0), a.slot_uid(1)}.isdisjoint({b.slot_uid(0), b.slot_uid(1)})
    finally:
        a.close()
        b.close()


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_run_is_killed(backend: str) -> None:
    async def go() -> int:
        pool = SandboxPool(SandboxConfig(backend=backend, concurrency=1))  # type: ignore[arg-type]
        try:
            task = asyncio.ensure_future(pool.run("import time\ntime.sleep(120)"))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return pool.slot_uid(0)
        finally:
            pool.close()

    uid = asyncio.run(go())
    assert processes_of_uid(uid) == []
