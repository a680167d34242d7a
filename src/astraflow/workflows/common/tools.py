"""Tool execution off the event loop: async tools are awaited, sync tools run in a thread pool.

A RaaS runs every episode of every task on one asyncio event loop; a tool that blocks that loop
(`time.sleep`, a subprocess wait, a slow search) stalls all episodes and the heartbeat with them.
`Tools.call` never blocks it: a coroutine function is awaited with a timeout, anything else runs in a
bounded thread pool with a timeout. A sync tool that times out keeps its thread until it returns
(Python cannot kill a thread): the episode gets a timeout result at once, but the pool slot stays busy.
Tools that can hang for ever belong in a subprocess (for model-written code: astraflow.sandbox).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave: its value, or why there is none."""

    ok: bool
    value: Any = None
    """The tool's return value (ok) ."""
    error: str = ""
    """timeout / unknown_tool / the exception's type and message (not ok)."""

    def text(self) -> str:
        """What to show the model: the value as text, or an error line."""
        return str(self.value) if self.ok else f"error: {self.error}"


class Tools:
    """A set of named tools (sync or async callables) and the executor that runs them."""

    def __init__(
        self, tools: dict[str, Callable[..., Any]] | None = None, *, timeout_s: float = 30.0, threads: int = 8
    ) -> None:
        """`timeout_s`: default per-call timeout; `threads`: sync tool calls running at once."""
        self.tools: dict[str, Callable[..., Any]] = dict(tools or {})
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="astraflow-tool")

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        """Add (or replace) a tool."""
        self.tools[name] = fn

    async def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """Run `fn` off the event loop; raises TimeoutError after timeout_s and whatever fn raises."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args, **kwargs), timeout)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, partial(fn, *args, **kwargs))
        result = await asyncio.wait_for(future, timeout)
        if inspect.isawaitable(result):
            # A sync function that returned a coroutine (e.g. a partial of an async one).
            return await asyncio.wait_for(result, timeout)
        return result

    async def call(self, name: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> ToolResult:
        """Call tool `name`; every failure (unknown tool, exception, timeout) becomes a ToolResult."""
        fn = self.tools.get(name)
        if fn is None:
            return ToolResult(False, error=f"unknown_tool {name!r} (have: {', '.join(sorted(self.tools))})")
        try:
            return ToolResult(True, await self.run(fn, *args, timeout_s=timeout_s, **kwargs))
        except TimeoutError:
            return ToolResult(False, error="timeout")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return ToolResult(False, error=f"{type(exc).__name__}: {exc}"[:500])

    def close(self) -> None:
        """Stop accepting calls; running sync calls finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
