"""The sidecar's watch on its engine: wait for it at start, ask its model, probe it after.

The engine is healthy while ``GET /health`` answers 200; an unhealthy engine makes the
sidecar report its workers unroutable (``WorkerStatus``) until it answers again.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import structlog

__all__ = ["EngineUnavailableError", "EngineWatch"]

log = structlog.get_logger(component="sidecar")
_PROBE_S = 2.0


class EngineUnavailableError(RuntimeError):
    """The engine never became healthy within the wait, or did not say its model."""


class EngineWatch:
    """The engine's health, as its ``/health`` answers."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str) -> None:
        self._session = session
        self.engine_url = engine_url.rstrip("/")
        self.healthy = False

    async def wait(self, wait_s: float) -> None:
        """Until the engine answers healthy; ``EngineUnavailableError`` after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        announced = False
        while not await self._ok():
            if time.monotonic() > deadline:
                raise EngineUnavailableError(
                    f"engine at {self.engine_url} not healthy after {wait_s:.0f}s"
                )
            if not announced:
                log.info("engine_waiting", engine_url=self.engine_url)
                announced = True
            await asyncio.sleep(0.1)
        self.healthy = True

    async def served_model(self) -> str:
        """The model the engine serves (the first of its ``/v1/models``)."""
        url = f"{self.engine_url}/v1/models"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 401:
                    raise EngineUnavailableError(
                        f"{url} answered 401: the engine wants its API key; pass "
                        "--engine-api-key-file (or set KVSIDECAR_ENGINE_API_KEY)"
                    )
                data = await resp.json(content_type=None)
            return str(data["data"][0]["id"])
        except (
            aiohttp.ClientError,
            TimeoutError,
            KeyError,
            IndexError,
            TypeError,
            ValueError,
        ) as exc:
            raise EngineUnavailableError(
                f"cannot learn the served model from {url} ({exc!r}); pass --model-id"
            ) from exc

    async def run(self) -> None:
        """Probe the engine every couple of seconds until cancelled."""
        while True:
            await asyncio.sleep(_PROBE_S)
            healthy = await self._ok()
            if healthy != self.healthy:
                log.warning("engine_health_changed", healthy=healthy)
            self.healthy = healthy

    async def _ok(self) -> bool:
        url = f"{self.engine_url}/health"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
