"""A program under the plain-rlimit sandbox that writes into the host's shared temp directories by
absolute path leaves nothing there once its call is over."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from astraflow.sandbox.config import SandboxConfig
from astraflow.sandbox.pool import SandboxPool


@pytest.mark.skipif(os.geteuid() != 0, reason="slot uids (and so the sweep) need root")
def test_rlimit_sandbox_leaves_nothing_in_shared_tmp() -> None:
    tag = uuid.uuid4().hex
    code = (
        "import os\n"
        f"open('/tmp/leak-{tag}', 'wb').write(b'x' * 4096)\n"
        f"os.makedirs('/tmp/leakdir-{tag}/deep')\n"
        f"open('/tmp/leakdir-{tag}/deep/f', 'w').write('y')\n"
        f"open('/var/tmp/leak-{tag}', 'w').write('z')\n"
        "print('wrote')\n"
    )

    async def main() -> bytes:
        pool = SandboxPool(SandboxConfig(backend="rlimit", concurrency=1))
        try:
            result = await pool.run(code)
            assert result.status == "ok", result
            return result.stdout
        finally:
            pool.close()

    assert asyncio.run(main()).strip() == b"wrote"
    left = [
        p
        for p in (Path(f"/tmp/leak-{tag}"), Path(f"/tmp/leakdir-{tag}"), Path(f"/var/tmp/leak-{tag}"))
        if p.exists()
    ]
    assert left == []
