"""A minimal JSON-over-HTTP/1.1 server on loopback for per-episode endpoints, on the RaaS event loop.

Each episode registers a random token; its URLs are `http://127.0.0.1:PORT/<token>/...` and every
request must also carry `Authorization: Bearer <token>`. Without both, the answer is 401, so another
local process cannot use (or even probe) an episode's endpoint. A token is revoked when its episode
ends. One response per connection (`Connection: close`): clients (httpx, requests, urllib) reconnect.
Request bodies are JSON only (chunked uploads are refused). A handler answers a JSON object, or an
`EventStream`, sent as server-sent events (`data: <json>` lines, then `data: [DONE]`), the body ending
when the connection closes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body (413 above it, before it is read): a long agent transcript is far smaller."""
READ_TIMEOUT_S = 30.0

Handler = Callable[[str, str, Any], Awaitable[Any]]
"""(method, path after the token, parsed JSON body or None) -> JSON-able response or EventStream."""


@dataclass
class EventStream:
    """A 200 answer sent as server-sent events: each item of `events` as one `data:` line of JSON."""

    events: AsyncIterator[dict[str, Any]]
    """The events, in order; `data: [DONE]` follows the last one."""


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new daemon thread, awaited: blocking agent code never holds the event loop, and a
    call still blocked when the process stops (its endpoint gone) does not keep the process alive, as
    a pool's worker threads would."""
    import threading

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # the awaiting task was cancelled
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def work() -> None:
        try:
            out, ok = fn(*args), True
        except BaseException as exc:  # handed to the awaiting task
            out, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, out)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=work, name="agent-call", daemon=True).start()
    return await fut


class HttpError(Exception):
    """An error answered to the client as an OpenAI-style JSON error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    500: "Internal Server Error",
}


@dataclass(frozen=True)
class _Request:
    """A request read in full and authorised: its handler, method, path and JSON body."""

    args: tuple[Handler, str, str, Any]


class LoopbackServer:
    """One HTTP server per process, shared by all episodes; started on first use."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.AbstractServer | None = None
        self._lock = asyncio.Lock()
        self.port = 0

    async def start(self) -> None:
        """Listen on 127.0.0.1 on a free port (idempotent)."""
        async with self._lock:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
                self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop every registration."""
        self._handlers.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def register(self, handler: Handler) -> str:
        """A new random token routed to `handler`; its base URL is `url(token)`."""
        token = secrets.token_urlsafe(24)
        self._handlers[token] = handler
        return token

    def revoke(self, token: str) -> None:
        """Refuse the token from now on."""
        self._handlers.pop(token, None)

    def url(self, token: str) -> str:
        """The token's base URL (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}/{token}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # the timeout bounds reading the request only: a long generation is bounded by the
            # episode's timeout, not cut off here
            read = await asyncio.wait_for(self._read(reader), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        status, body = read if isinstance(read, tuple) else await self._call(*read.args)
        if isinstance(body, EventStream):
            await self._stream(writer, body)
            return
        data = json.dumps(body).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode() + data)
            await writer.drain()
            if isinstance(read, tuple):
                await _linger(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, stream: EventStream) -> None:
        # No Content-Length: the body is delimited by closing the connection (HTTP/1.1 allows it and
        # every client reads it), so no chunked encoding is needed.
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            "Connection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode())
            async for event in stream.events:
                writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:  # the client went away mid-stream; what it was sent is recorded anyway
            pass
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> tuple[int, Any] | _Request:
        """The request to answer, or an error answer (status, body) when it cannot be served."""
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 400, HttpError(400, "request headers too large").body()
        if len(raw) > MAX_HEADER_BYTES:
            return 400, HttpError(400, "request headers too large").body()
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return 400, HttpError(400, "malformed request line").body()
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        segs = target.split("?", 1)[0].lstrip("/").split("/", 1)
        token, path = segs[0], "/" + (segs[1] if len(segs) > 1 else "")
        handler = self._handlers.get(token)
        given = headers.get("authorization", "")
        # compare_digest on equal-length bytes: no timing hint about the token
        if handler is None or not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return 401, HttpError(401, "unknown endpoint or wrong api key", "authentication_error").body()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return 400, HttpError(400, "chunked request bodies are not supported").body()
        length = headers.get("content-length", "0") or "0"
        if not length.isdigit():
            return 400, HttpError(400, "Content-Length is not a number").body()
        size = int(length)
        if size > MAX_BODY_BYTES:
            return 413, HttpError(413, f"request body over {MAX_BODY_BYTES} bytes").body()
        payload: Any = None
        if size:
            # parsed in a worker thread: the loop serves the episode's other requests meanwhile
            payload = await asyncio.to_thread(_parse, await reader.readexactly(size))
            if isinstance(payload, HttpError):
                return payload.status, payload.body()
        return _Request((handler, method, path, payload))

    @staticmethod
    async def _call(handler: Handler, method: str, path: str, payload: Any) -> tuple[int, Any]:
        try:
            return 200, await handler(method, path, payload)
        except HttpError as exc:
            return exc.status, exc.body()
        except Exception as exc:  # a bug or an engine error: the agent sees it, the server lives on
            return 500, HttpError(500, f"{type(exc).__name__}: {exc}", "server_error").body()


def _parse(data: bytes) -> Any:
    """A request body's JSON, or the HttpError to answer (too deeply nested JSON included)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
        return HttpError(400, f"request body is {why}")


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an answer given before the request's body was read (a refused length, a bad header): end
    our side and read what the client still sends for a moment, so that closing with unread bytes does
    not reset the connection before the client has read the answer."""
    if writer.can_write_eof():
        writer.write_eof()
    got, deadline = 0, asyncio.get_running_loop().time() + 1.0
    while got < 1 << 20:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        try:
            chunk = await asyncio.wait_for(reader.read(1 << 16), left)
        except (TimeoutError, ConnectionError):
            return
        if not chunk:
            return
        got += len(chunk)
