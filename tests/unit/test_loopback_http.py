"""The per-episode loopback HTTP server: a slow handler is not cut off by the request read timeout,
and an EventStream answer arrives as server-sent events, over a real socket."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from astraflow.workflows.common import loopback_http
from astraflow.workflows.common.loopback_http import EventStream, LoopbackServer


def _post(url: str, token: str) -> tuple[int, str, bytes]:
    req = urllib.request.Request(
        url, data=b"{}", headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


def test_slow_answers_and_event_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loopback_http, "READ_TIMEOUT_S", 0.05)

    async def events() -> AsyncIterator[dict[str, Any]]:
        for i in range(3):
            yield {"i": i}

    async def handler(method: str, path: str, body: Any) -> Any:
        await asyncio.sleep(0.2)  # longer than the read timeout: a generation may take long
        return EventStream(events()) if path == "/stream" else {"path": path, "body": body}

    async def main() -> list[tuple[int, str, bytes]]:
        server = LoopbackServer()
        await server.start()
        token = server.register(handler)
        try:
            return [
                await asyncio.to_thread(_post, f"{server.url(token)}{p}", token)
                for p in ("/plain", "/stream")
            ]
        finally:
            await server.close()

    (status, kind, body), (s_status, s_kind, s_body) = asyncio.run(main())
    assert status == 200 and kind == "application/json" and json.loads(body) == {"path": "/plain", "body": {}}
    assert s_status == 200 and s_kind == "text/event-stream"
    assert s_body == b"".join(b'data: {"i": %d}\n\n' % i for i in range(3)) + b"data: [DONE]\n\n"
