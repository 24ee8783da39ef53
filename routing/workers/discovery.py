"""The gateway's sidecar-backed workers: discovery, event feeds, health and load views.

A sidecar URL (``--sidecar URL`` or a line of ``--sidecar-file``) names one engine replica;
``GET /v1/workers`` on it lists its workers (one per data-parallel rank). Each worker gets a
``SidecarFeed`` that keeps its blocks in the router's index. A worker is *routable* while
its feed is live and its sidecar's last load report says so; the file is re-read when it
changes, adding and removing sidecars.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import structlog

from kvcore.stream import LoadReport
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import SidecarFeed

__all__ = ["SidecarPool", "SidecarWorker", "read_sidecar_file"]

log = structlog.get_logger(component="sidecar_pool")
_DISCOVERY_RETRY_S = 0.2
_FILE_POLL_S = 1.0


@dataclass(slots=True)
class SidecarWorker:
    """One worker (a DP rank of one engine) behind a sidecar."""

    worker_id: str
    sidecar_url: str
    dp_rank: int
    feed: SidecarFeed
    task: asyncio.Task[None] | None = None

    @property
    def generate_url(self) -> str:
        return f"{self.sidecar_url}/v1/kvsidecar/generate"

    @property
    def role(self) -> str:
        return self.feed.role

    @property
    def load(self) -> LoadReport | None:
        return self.feed.load

    @property
    def routable(self) -> bool:
        load = self.feed.load
        return self.feed.connected and (load is None or load.routable)

    @property
    def reason(self) -> str:
        if not self.feed.connected:
            return self.feed.error or "event stream not connected"
        load = self.feed.load
        return load.reason if load is not None and not load.routable else ""


@dataclass(slots=True)
class _Sidecar:
    url: str
    discovery: asyncio.Task[None] | None = None
    workers: list[SidecarWorker] = field(default_factory=list)


def read_sidecar_file(path: Path) -> list[str]:
    """Sidecar URLs, one per line; blank lines and ``#`` comments ignored."""
    urls = []
    for raw in path.read_text().splitlines():
        url = raw.split("#", 1)[0].strip()
        if url:
            urls.append(url.rstrip("/"))
    return urls


class SidecarPool:
    """Every sidecar the gateway routes to, and their workers."""

    def __init__(
        self,
        router: KvRouter,
        session: aiohttp.ClientSession,
        *,
        model_id: str,
        dead_after_s: float = 5.0,
        on_added: Callable[[SidecarWorker], None] | None = None,
        on_removed: Callable[[SidecarWorker], None] | None = None,
    ) -> None:
        self.router = router
        self._on_added = on_added
        self._on_removed = on_removed
        self.model_id = model_id
        self.dead_after_s = dead_after_s
        self._session = session
        self._sidecars: dict[str, _Sidecar] = {}
        self._workers: dict[str, SidecarWorker] = {}
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
        if sidecar is None:
            return
        tasks = [sidecar.discovery] + [w.task for w in sidecar.workers]
        for task in tasks:
            if task is not None:
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in sidecar.workers:
            self._workers.pop(worker.worker_id, None)
            self.router.remove_worker(worker.worker_id)
            if self._on_removed is not None:
                self._on_removed(worker)
        log.info("sidecar_removed", url=url)

    def sync(self, urls: Iterable[str]) -> list[asyncio.Task[None]]:
        """Make the pool follow exactly ``urls``; returns the removals to await."""
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

    # --- views --------------------------------------------------------------------------

    @property
    def workers(self) -> list[SidecarWorker]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> SidecarWorker | None:
        return self._workers.get(worker_id)

    def routable(self, role: str | None = None) -> list[str]:
        """Ids of the workers placement may use (optionally of one role)."""
        return [
            w.worker_id
            for w in self._workers.values()
            if w.routable and (role is None or w.role == role)
        ]

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
                    info = await r.json(content_type=None)
                worker_ids = [str(w) for w in info["workers"]]
                break
            except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
                log.debug("sidecar_discovery_retry", url=sidecar.url, error=repr(exc))
                await asyncio.sleep(retry)
                retry = min(retry * 2, 2.0)
        for rank, worker_id in enumerate(worker_ids):
            if worker_id in self._workers:
                log.error("worker_id_duplicated", worker_id=worker_id, url=sidecar.url)
                continue
            feed = SidecarFeed(
                sidecar.url,
                self.router,
                self._session,
                model_id=self.model_id,
                worker=worker_id,
                dead_after_s=self.dead_after_s,
            )
            worker = SidecarWorker(worker_id, sidecar.url, rank, feed)
            worker.task = asyncio.create_task(feed.run(), name=f"feed {worker_id}")
            sidecar.workers.append(worker)
            self._workers[worker_id] = worker
            if self._on_added is not None:
                self._on_added(worker)
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
