"""Where TensorRT-LLM's KV events come from: the HTTP poller and the in-process LLM API.

Both *drain* the engine's event queue, so exactly one consumer may exist per server: this
adapter must be the only poller of ``POST /kv_cache_events`` (nothing else, Dynamo
included, may poll the same server).

* ``HttpEventSource``: ``POST {url}/kv_cache_events`` every ``poll_interval_s`` (at once
  again when an answer was non-empty); answers are raw JSON bytes, decoded by the caller.
  An unreachable engine is logged once per outage and retried with backoff; a restart shows
  up as event ids starting over, which the core turns into a new epoch.
* ``LlmApiEventSource``: ``async for event in llm.get_kv_cache_events_async(timeout)`` on a
  ``tensorrt_llm.LLM`` in this process (duck-typed: anything with that method works); an
  ``IndexError`` or ``QueueEmpty`` ends one drain, as trtllm-serve's own handler treats it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import structlog

from kvcore.extras import MissingExtraError

__all__ = ["HttpEventSource", "LlmApiEventSource", "require_tensorrt_llm"]

log = structlog.get_logger(component="adapters.trtllm")

OnPayload = Callable[[bytes], Awaitable[None]]
OnObjects = Callable[[list[Any]], Awaitable[None]]


def require_tensorrt_llm() -> Any:
    """Import ``tensorrt_llm`` (lazily), or say which extra provides it."""
    try:
        import tensorrt_llm  # type: ignore[import-not-found]  # noqa: PLC0415
    except ImportError as exc:
        raise MissingExtraError(
            "running TensorRT-LLM in-process (LLM API events)", "trtllm", "tensorrt_llm", exc
        ) from exc
    return tensorrt_llm


class HttpEventSource:
    """Polls one ``trtllm-serve`` for KV events until cancelled."""

    def __init__(
        self,
        url: str,
        on_payload: OnPayload,
        *,
        poll_interval_s: float = 0.05,
        request_timeout_s: float = 5.0,
        max_backoff_s: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/kv_cache_events"
        self._headers = headers or {}
        self._on_payload = on_payload
        self._interval = poll_interval_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._max_backoff = max_backoff_s
        self.polls = 0

    async def run(self) -> None:
        backoff = self._interval
        down = False
        async with aiohttp.ClientSession(timeout=self._timeout, headers=self._headers) as session:
            while True:
                try:
                    async with session.post(self.url) as resp:
                        body = await resp.read()
                        if resp.status != 200:
                            raise _PollError(f"HTTP {resp.status}: {body[:200]!r}")
                except (aiohttp.ClientError, TimeoutError, _PollError) as exc:
                    if not down:
                        log.warning("kv_event_poll_failed", url=self.url, error=repr(exc))
                        down = True
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._max_backoff)
                    continue
                self.polls += 1
                if down:
                    log.info("kv_event_poll_recovered", url=self.url)
                    down = False
                backoff = self._interval
                empty = body.strip() in (b"[]", b"")
                if not empty:
                    await self._on_payload(body)
                else:
                    await asyncio.sleep(self._interval)


class _PollError(Exception):
    pass


class _EventLlm(Protocol):
    def get_kv_cache_events_async(self, timeout: float | None = ...) -> Any: ...


class LlmApiEventSource:
    """Drains a ``tensorrt_llm.LLM``'s KV events in this process until cancelled."""

    def __init__(
        self,
        llm: _EventLlm,
        on_objects: OnObjects,
        *,
        poll_interval_s: float = 0.05,
        drain_timeout_s: float = 0.0,
    ) -> None:
        if not hasattr(llm, "get_kv_cache_events_async"):
            raise TypeError(
                "LlmApiEventSource needs a tensorrt_llm.LLM (an object with "
                "get_kv_cache_events_async); got " + type(llm).__name__
            )
        self._llm = llm
        self._on_objects = on_objects
        self._interval = poll_interval_s
        self._drain_timeout = drain_timeout_s

    async def drain_once(self) -> list[Any]:
        """Every event queued now (possibly none)."""
        events: list[Any] = []
        with contextlib.suppress(IndexError, asyncio.QueueEmpty):
            async for event in self._llm.get_kv_cache_events_async(self._drain_timeout):
                events.append(event)  # noqa: PERF401 - keep what came before an error
        return events

    async def run(self) -> None:
        while True:
            events = await self.drain_once()
            if events:
                await self._on_objects(events)
            else:
                await asyncio.sleep(self._interval)
