"""The gateway's sidecars: discovery, membership and one event feed per worker.

A sidecar URL (``--sidecar URL`` or a line of ``--sidecar-file``) names one engine replica;
``GET /v1/workers`` on it lists its workers (one per data-parallel rank), its role and where a
prefill engine serves its own KV transfer. Each worker joins the registry and gets a
``SidecarFeed`` that keeps its blocks in the router's index and tells the registry what its
stream says. The file is re-read when it changes, adding and removing sidecars.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from routing.config import WorkerAddress
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import LiveEvents, SidecarFeed
from routing.workers.registry import Worker, WorkerKind, WorkerRegistry

__all__ = ["SidecarDiscovery", "engine_address", "read_sidecar_file"]

log = structlog.get_logger(component="sidecar_discovery")
_DISCOVERY_RETRY_S = 0.2
_FILE_POLL_S = 1.0


@dataclass(slots=True)
class _Sidecar:
    url: str
    discovery: asyncio.Task[None] | None = None
    worker_ids: list[str] = field(default_factory=list)
    feeds: list[asyncio.Task[None]] = field(default_factory=list)


def read_sidecar_file(path: Path) -> list[str]:
    """Sidecar URLs, one per line; blank lines and ``#`` comments ignored."""
    urls = []
    for raw in path.read_text().splitlines():
        url = raw.split("#", 1)[0].strip()
        if url:
            urls.append(url.rstrip("/"))
    return urls


class SidecarDiscovery:
    """Every sidecar the gateway follows, and the feeds of their workers."""

    def __init__(
        self,
        registry: WorkerRegistry,
        router: KvRouter,
        session: aiohttp.ClientSession,
        *,
        model_id: str,
        models: tuple[str, ...],
        dead_after_s: float = 5.0,
        control_header: bytes = b"",
        live_events: LiveEvents | None = None,
    ) -> None:
        self.registry = registry
        self.control_header = control_header  # sent on each request leg to its workers
        self.router = router
        self.model_id = model_id
        self.models = models
        self.dead_after_s = dead_after_s
        self.live_events = live_events  # --events-via nats: the events' other source
        self._session = session
        self._sidecars: dict[str, _Sidecar] = {}
        self.pending: dict[str, str] = {}  # sidecar URL → why its workers are not known yet
        self._file_task: asyncio.Task[None] | None = None

    # --- membership ---------------------------------------------------------------------

    def add(self, url: str) -> None:
        """Start discovering and following the sidecar at ``url`` (idempotent)."""
        url = url.rstrip("/")
        if url in self._sidecars:
            return
        sidecar = _Sidecar(url)
        sidecar.discovery = asyncio.create_task(self._discover(sidecar), name=f"discover {url}")
        self._sidecars[url] = sidecar

    async def remove(self, url: str) -> None:
        """Stop following a sidecar; its workers leave placement and the index."""
        sidecar = self._sidecars.pop(url.rstrip("/"), None)
        self.pending.pop(url.rstrip("/"), None)
        if sidecar is None:
            return
        tasks = [t for t in (sidecar.discovery, *sidecar.feeds) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for worker_id in sidecar.worker_ids:
            self.registry.remove(worker_id)
            self.router.remove_worker(worker_id)
        log.info("sidecar_removed", url=url)

    def sync(self, urls: Iterable[str]) -> list[asyncio.Task[None]]:
        """Follow exactly ``urls``; returns the removals to await."""
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted - set(self._sidecars):
            self.add(url)
        return [asyncio.create_task(self.remove(u)) for u in set(self._sidecars) - wanted]

    def watch_file(self, path: Path) -> None:
        """Follow the sidecar list in ``path``, re-read whenever it changes."""
        self._file_task = asyncio.create_task(self._watch(path), name=f"watch {path}")

    async def aclose(self) -> None:
        if self._file_task is not None:
            self._file_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._file_task
        for url in list(self._sidecars):
            await self.remove(url)

    @property
    def sidecar_urls(self) -> list[str]:
        return list(self._sidecars)

    # --- internals ----------------------------------------------------------------------

    async def _discover(self, sidecar: _Sidecar) -> None:
        retry = _DISCOVERY_RETRY_S
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with self._session.get(f"{sidecar.url}/v1/workers", timeout=timeout) as r:
                    if r.status in (401, 403):
                        raise _Unauthorized(r.status)
                    info: dict[str, Any] = await r.json(content_type=None)
                worker_ids = [str(w) for w in info["workers"]]
                bootstrap = _bootstrap(info.get("bootstrap"))
                engine = engine_address(sidecar.url, info.get("engine_url"))
                reasoning = info.get("reasoning_parser")
                break
            except _Unauthorized as exc:
                reason = (f"unauthorized: the sidecar answered {exc.status} (its "
                          "--control-token-file differs from --sidecar-token-file)")
                if self.pending.get(sidecar.url) != reason:
                    log.error("sidecar_unauthorized", url=sidecar.url, status=exc.status,
                              hint="give the gateway the sidecar's token: --sidecar-token-file")
                self.pending[sidecar.url] = reason
                await asyncio.sleep(retry)
                retry = min(retry * 2, 2.0)
            except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
                self.pending[sidecar.url] = f"not reachable yet: {exc!r}"
                log.debug("sidecar_discovery_retry", url=sidecar.url, error=repr(exc))
                await asyncio.sleep(retry)
                retry = min(retry * 2, 2.0)
        self.pending.pop(sidecar.url, None)
        address = WorkerAddress.parse(sidecar.url)
        for rank, worker_id in enumerate(worker_ids):
            if self.registry.get(worker_id) is not None:
                log.error("worker_id_duplicated", worker_id=worker_id, url=sidecar.url)
                continue
            self.registry.add(Worker(worker_id, address, WorkerKind.SIDECAR, dp_rank=rank,
                                     models=self.models, bootstrap=bootstrap, engine=engine,
                                     control_header=self.control_header,
                                     reasoning_parser=reasoning if isinstance(reasoning, str)
                                     else None))
            feed = SidecarFeed(sidecar.url, self.router, self._session, model_id=self.model_id,
                               worker=worker_id, dead_after_s=self.dead_after_s,
                               listener=self.registry, live_events=self.live_events)
            sidecar.worker_ids.append(worker_id)
            sidecar.feeds.append(asyncio.create_task(feed.run(), name=f"feed {worker_id}"))
        log.info("sidecar_discovered", url=sidecar.url, worker_ids=worker_ids)

    async def _watch(self, path: Path) -> None:
        last: float | None = None
        while True:
            try:
                mtime = path.stat().st_mtime
                if mtime != last:
                    last = mtime
                    urls = await asyncio.to_thread(read_sidecar_file, path)
                    for task in self.sync(urls):
                        await task
                    log.info("sidecar_file_loaded", path=str(path), sidecars=len(urls))
            except OSError as exc:
                log.warning("sidecar_file_unreadable", path=str(path), error=str(exc))
            await asyncio.sleep(_FILE_POLL_S)


_LOCAL_HOSTS = frozenset({"localhost", "0.0.0.0", "::", "::1"})


def engine_address(sidecar_url: str, engine_url: Any) -> WorkerAddress | None:
    """Where others reach a sidecar's engine: its ``engine_url``, whose loopback or
    unspecified host (the engine beside the sidecar, in its pod) is the sidecar's host.
    None when the sidecar does not say (an older sidecar) or says nonsense."""
    if not isinstance(engine_url, str):
        return None
    try:
        engine = WorkerAddress.parse(engine_url)
    except ValueError:
        return None
    host = engine.host
    if host in _LOCAL_HOSTS or host.startswith("127."):
        host = WorkerAddress.parse(sidecar_url).host
        shown = f"[{host}]" if ":" in host else host
        engine = WorkerAddress.parse(f"http://{shown}:{engine.port}{engine.base_path}")
    return engine


class _Unauthorized(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def _bootstrap(value: Any) -> tuple[str, int] | None:
    if isinstance(value, dict) and isinstance(value.get("host"), str):
        port = value.get("port")
        if isinstance(port, int):
            return value["host"], port
    return None
