"""Hostile requests to an episode's OpenAI endpoint over a real socket: each is answered with a 4xx
(nothing left unanswered), and the endpoint serves the next request."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from astraflow.workflows.common import loopback_http
from astraflow.workflows.common.loopback_http import LoopbackServer
from astraflow.workflows.openai.endpoint import MAX_MESSAGES, EpisodeEndpoint


def _http(port: int, token: str, body: bytes, length: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST body to the chat route on a raw socket; (status, JSON answer)."""
    head = (
        f"POST /{token}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            s.sendall(body)
        except OSError:
            pass  # refused before the body was read: the answer is still there
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_huge_nested_and_long_requests_are_answered_4xx() -> None:
    async def main() -> list[tuple[int, dict[str, Any]]]:
        server = LoopbackServer()
        await server.start()
        # the messages cap is checked before the policy client is used to render anything
        token = server.register(EpisodeEndpoint({"actor": object()}, max_tokens=100).handle)  # type: ignore[dict-item]
        many = {"model": "actor", "messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}
        cases = [
            b"x" * (loopback_http.MAX_BODY_BYTES + 1),
            b"[" * 200_000 + b"]" * 200_000,
            json.dumps(many).encode(),
            b"{not json",
        ]
        try:
            out = [await asyncio.to_thread(_http, server.port, token, body) for body in cases]
            out.append(await asyncio.to_thread(_http, server.port, token, b"{}", "12abc"))
            out.append(await asyncio.to_thread(_http, server.port, token, b"[]"))
            return out
        finally:
            await server.close()

    (big, nested, long, bad, length, after) = asyncio.run(main())
    assert big[0] == 413, big
    assert nested[0] == 400 and "nested" in nested[1]["error"]["message"], nested
    assert long[0] == 400 and "messages" in long[1]["error"]["message"], long
    assert bad[0] == 400 and length[0] == 400
    assert after[0] == 400 and "JSON object" in after[1]["error"]["message"]  # still serving
