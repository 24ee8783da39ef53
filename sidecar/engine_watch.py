"""The sidecar's watch on its engine: wait for it at start, ask its model, probe it after.

The engine is healthy while ``GET /health`` answers 200; an unhealthy engine makes the
sidecar report its workers unroutable (``WorkerStatus``) until it answers again.

A probe that only *times out* does not retire an engine that demonstrably works: when the
engine's output advanced while the probe waited (tokens relayed, KV events received: the
``progress`` count), a slow answer is a busy engine, not a dead one (an engine whose
``/health`` is a generation can queue it behind its work). An answer other than 200, or no
connection, is unhealthy whatever flows: the engine said so, or is gone.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import aiohttp
import structlog

__all__ = ["EngineUnavailableError", "EngineWatch"]

log = structlog.get_logger(component="sidecar")
_PROBE_S = 2.0
PROBE_TIMEOUT_S = 5.0


class Probe(enum.Enum):
    """How one ``GET /health`` went."""

    OK = "ok"
    FAILED = "failed"  # an answer other than 200, or no connection
    TIMED_OUT = "timed_out"


class EngineUnavailableError(RuntimeError):
    """The engine never became healthy within the wait, or did not say its model."""


class EngineWatch:
    """The engine's health, as its ``/health`` answers and its output advances."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._session = session
        self.engine_url = engine_url.rstrip("/")
        self.probe_timeout_s = probe_timeout_s
        self.healthy = False
        # The engine's output so far (any count that grows while it works); set by the
        # sidecar once it relays requests and events.
        self.progress: Callable[[], int] = lambda: 0
        self.slow_probes = 0  # probes that timed out while the engine's output advanced

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
            await self.check()

    async def check(self) -> bool:
        """One probe, and the verdict it gives (``healthy``)."""
        before = self.progress()
        probe = await self._probe()
        healthy = probe is Probe.OK
        if probe is Probe.TIMED_OUT and self.progress() > before:
            healthy = self.healthy  # busy, not dead: the verdict stands
            self.slow_probes += 1
            log.info("engine_probe_slow", timeout_s=self.probe_timeout_s, healthy=healthy)
        if healthy != self.healthy:
            log.warning("engine_health_changed", healthy=healthy, probe=probe.value)
        self.healthy = healthy
        return healthy

    async def _ok(self) -> bool:
        return await self._probe() is Probe.OK

    async def _probe(self) -> Probe:
        url = f"{self.engine_url}/health"
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self._session.get(url, timeout=timeout) as resp:
                return Probe.OK if resp.status == 200 else Probe.FAILED
        except TimeoutError:
            return Probe.TIMED_OUT
        except aiohttp.ClientError:
            return Probe.FAILED
