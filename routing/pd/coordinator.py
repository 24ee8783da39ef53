"""Prefill/decode disaggregation in the gateway: pools, pair placement, backpressure, metrics.

Sidecars say which pool their worker serves (``--role agg|prefill|decode``, carried on their
event stream). When the fleet has both prefill and decode workers, the gateway serves each
request as a *pair*:

* the prefill worker is scored by overlap and prefill load (``Pool.PREFILL``: uncached prompt
  blocks plus the prefill already queued there);
* the decode worker by how full its KV would be (``Pool.DECODE``: decode blocks over
  capacity, capacity learned from the sidecar's ``/v1/kvsidecar/pd/info``), among the workers
  with room for the request's prompt and ``max_tokens`` (reserved while it runs).

No decode worker with room: the request *waits* (backpressure) until one frees up, for at
most ``--pd-queue-timeout-s``; then it gets 503 with ``retry-after``. Nothing is dropped.

Two ways to run a pair (``--pd-mode``; ``disagg_request.py``): ``auto`` hands the KV over
between our sidecars (the decode sidecar drives the prefill leg and pulls the blocks,
``sidecar/disagg.py``); ``sglang`` uses SGLang's own PD transfer, sending the same request
with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` to both, as SGLang's router
does, and streaming the decode side. ``--kv-load-failure-policy``: a failed handoff either
fails the request (502, ``kv_transfer_failed``) or re-runs it on an aggregated worker.

Aggregated requests never go to prefill or decode workers (``agg_only``).
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from routing.pd.pd_request import PdRequest
from routing.placement.scorer import Placement, Pool

if TYPE_CHECKING:
    from routing.prompt.openai_api import OpenAIRequest
    from routing.prompt.preparer import PreparedPrompt
    from routing.serve.gateway import Gateway
    from routing.serve.http_server import ServerConnection
    from routing.workers.discovery import SidecarWorker
    from routing.workers.registry import Worker

__all__ = ["FailurePolicy", "PdCoordinator", "PdMetrics", "PdMode", "PdPair", "SidecarPdInfo"]

log = structlog.get_logger("routing.pd.coordinator").bind(component="gateway")

DEFAULT_RESERVE_TOKENS = 256  # decode room reserved for a request without max_tokens


class PdMode(enum.Enum):
    """How the gateway serves requests when the fleet has prefill and decode workers."""

    AUTO = "auto"  # KV handoff between our sidecars
    SGLANG = "sglang"  # SGLang's own PD transfer (bootstrap room), our placement
    OFF = "off"  # aggregated workers only


class FailurePolicy(enum.Enum):
    """What a failed or timed-out KV handoff does to the request."""

    FAIL = "fail"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class SidecarPdInfo:
    """A sidecar's ``/v1/kvsidecar/pd/info``."""

    role: str
    capacity_blocks: int | None
    bootstrap_host: str | None
    bootstrap_port: int | None


@dataclass(frozen=True, slots=True)
class PdPair:
    """The two workers of one disaggregated request and their placements."""

    prefill: SidecarWorker
    decode: SidecarWorker
    prefill_placement: Placement
    decode_placement: Placement
    reserve_blocks: int


class PdMetrics:
    """Counters of disaggregated serving, exported on the gateway's ``/metrics``."""

    def __init__(self) -> None:
        self.requests = 0  # served as a prefill/decode pair
        self.completed = 0
        self.transfer_failures: dict[str, int] = {"fail": 0, "fallback": 0}
        self.fallbacks: dict[str, int] = {"rerun": 0, "no_worker": 0}
        self.backpressure_waits = 0
        self.backpressure_rejects = 0
        self.waiting = 0

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("kvsidecar_gateway_pd_requests",
                                "Requests served by a prefill/decode pair")
        c.add_metric([], self.requests)
        yield c
        c = CounterMetricFamily("kvsidecar_gateway_pd_completed",
                                "Disaggregated requests answered in full")
        c.add_metric([], self.completed)
        yield c
        c = CounterMetricFamily("kvsidecar_gateway_kv_transfer_failures",
                                "KV handoffs that failed or timed out, by failure policy",
                                labels=["policy"])
        for policy, n in self.transfer_failures.items():
            c.add_metric([policy], n)
        yield c
        c = CounterMetricFamily("kvsidecar_gateway_pd_fallbacks",
                                "Failed handoffs re-run aggregated (rerun) or left without an "
                                "aggregated worker (no_worker)", labels=["outcome"])
        for outcome, n in self.fallbacks.items():
            c.add_metric([outcome], n)
        yield c
        c = CounterMetricFamily("kvsidecar_gateway_pd_backpressure_waits",
                                "Requests that waited for room in the decode pool")
        c.add_metric([], self.backpressure_waits)
        yield c
        c = CounterMetricFamily("kvsidecar_gateway_pd_backpressure_rejects",
                                "Requests answered 503 after --pd-queue-timeout-s without room")
        c.add_metric([], self.backpressure_rejects)
        yield c
        g = GaugeMetricFamily("kvsidecar_gateway_pd_waiting",
                              "Requests waiting for room in the decode pool now")
        g.add_metric([], self.waiting)
        yield g


class PdCoordinator:
    """The gateway's disaggregation: which requests go to a pair, and which pair."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        cfg = gw.cfg
        self.mode = PdMode(cfg.pd_mode)
        self.policy = FailurePolicy(cfg.kv_load_failure_policy)
        self.queue_timeout_s = cfg.pd_queue_timeout_s
        self.transfer_timeout_s = cfg.kv_transfer_timeout_s
        self.metrics = PdMetrics()
        gw.metrics.registry.register(self.metrics)
        self._info: dict[str, SidecarPdInfo] = {}
        self._reserved: dict[str, int] = {}  # decode worker → blocks reserved by its requests
        self._freed = asyncio.Event()

    # --- pools -----------------------------------------------------------------------------

    def _role(self, worker_id: str) -> str:
        sidecars = self.gw.sidecars
        feed = sidecars.get(worker_id) if sidecars is not None else None
        return "agg" if feed is None else feed.role

    def has_roles(self) -> bool:
        sidecars = self.gw.sidecars
        return sidecars is not None and any(w.role != "agg" for w in sidecars.workers)

    def agg_only(self, workers: list[Worker]) -> list[Worker]:
        """The workers aggregated requests may use: never a prefill or decode worker."""
        if not self.has_roles():
            return workers
        return [w for w in workers if self._role(w.worker_id) == "agg"]

    def pool(self, role: str) -> list[SidecarWorker]:
        """Routable, healthy sidecar workers of one role."""
        sidecars = self.gw.sidecars
        if sidecars is None:
            return []
        workers = self.gw.workers.workers
        return [
            w for w in sidecars.workers
            if w.role == role and w.routable
            and (gw_worker := workers.get(w.worker_id)) is not None and gw_worker.healthy
        ]

    def takes(self, prepared: PreparedPrompt) -> bool:
        """Serve this request as a pair? (PD on, tokenized, and both pools present.)"""
        if self.mode is PdMode.OFF or prepared.token_ids is None:
            return False
        return bool(self.pool("prefill")) and bool(self.pool("decode"))

    # --- sidecar info ------------------------------------------------------------------------

    async def info(self, worker: SidecarWorker) -> SidecarPdInfo:
        """The sidecar's PD info (fetched once); a decode worker's capacity feeds the scorer."""
        known = self._info.get(worker.sidecar_url)
        if known is not None:
            return known
        session = self.gw._session
        assert session is not None
        url = f"{worker.sidecar_url}/v1/kvsidecar/pd/info"
        timeout = aiohttp.ClientTimeout(total=self.gw.cfg.connect_timeout_s)
        try:
            async with session.get(url, timeout=timeout) as resp:
                body: dict[str, Any] = await resp.json(content_type=None)
            capacity = body.get("capacity_blocks")
            info = SidecarPdInfo(
                str(body.get("role") or worker.role),
                capacity if isinstance(capacity, int) and capacity > 0 else None,
                body.get("bootstrap_host"),
                body.get("bootstrap_port"),
            )
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            log.warning("pd_info_unavailable", url=url, error=repr(exc))
            return SidecarPdInfo(worker.role, None, None, None)
        self._info[worker.sidecar_url] = info
        if info.capacity_blocks is not None:
            self.gw.router.load.set_capacity(worker.worker_id, info.capacity_blocks)
        return info

    # --- pair placement ----------------------------------------------------------------------

    def reserve_blocks(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """Decode blocks a request may come to hold: its prompt and all its output."""
        out = DEFAULT_RESERVE_TOKENS if max_tokens is None else max_tokens
        return math.ceil((prompt_tokens + out) / self.gw.router.block_size)

    def _has_room(self, worker: SidecarWorker, need: int) -> bool:
        info = self._info.get(worker.sidecar_url)
        capacity = None if info is None else info.capacity_blocks
        if capacity is None:
            return True
        return self._reserved.get(worker.worker_id, 0) + need <= capacity

    async def place_pair(
        self, block_hashes: list[int] | Any, prompt_tokens: int, max_tokens: int | None
    ) -> PdPair | str:
        """A pair, or why there is none (the caller answers 503). Waits while the decode pool
        is full, up to ``--pd-queue-timeout-s``."""
        router = self.gw.router
        need = self.reserve_blocks(prompt_tokens, max_tokens)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        waited = False
        try:
            while True:
                prefills = self.pool("prefill")
                decodes = self.pool("decode")
                if not prefills or not decodes:
                    return "no prefill or no decode worker is available"
                for worker in decodes:
                    await self.info(worker)
                prefill = router.place(block_hashes, prompt_tokens,
                                       [w.worker_id for w in prefills], pool=Pool.PREFILL)
                roomy = [w.worker_id for w in decodes if self._has_room(w, need)]
                decode = (router.place(block_hashes, prompt_tokens, roomy, pool=Pool.DECODE)
                          if roomy else None)
                if prefill is not None and decode is not None:
                    by_id = {w.worker_id: w for w in (*prefills, *decodes)}
                    self._reserved[decode.worker_id] = (
                        self._reserved.get(decode.worker_id, 0) + need)
                    return PdPair(by_id[prefill.worker_id], by_id[decode.worker_id], prefill,
                                  decode, need)
                if not any(self._fits_ever(w, need) for w in decodes):
                    return (f"the request needs {need} KV blocks for its prompt and max_tokens; "
                            "no decode worker has that many")
                left = deadline - loop.time()
                if left <= 0:
                    self.metrics.backpressure_rejects += 1
                    return (f"every decode worker is full (the request needs {need} KV "
                            f"blocks); waited {self.queue_timeout_s:g}s, retry later")
                if not waited:
                    waited = True
                    self.metrics.backpressure_waits += 1
                    self.metrics.waiting += 1
                freed = self._freed
                try:
                    await asyncio.wait_for(freed.wait(), timeout=min(left, 0.5))
                except TimeoutError:
                    pass
        finally:
            if waited:
                self.metrics.waiting -= 1

    def _fits_ever(self, worker: SidecarWorker, need: int) -> bool:
        info = self._info.get(worker.sidecar_url)
        return info is None or info.capacity_blocks is None or need <= info.capacity_blocks

    def release(self, pair: PdPair) -> None:
        """The pair's request ended: its decode room is free again; wake the waiters."""
        wid = pair.decode.worker_id
        left = self._reserved.get(wid, 0) - pair.reserve_blocks
        if left > 0:
            self._reserved[wid] = left
        else:
            self._reserved.pop(wid, None)
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    # --- requests ----------------------------------------------------------------------------

    def start(
        self,
        conn: ServerConnection,
        key: str,
        request_id: bytes,
        label: str,
        parsed: OpenAIRequest,
        prepared: PreparedPrompt,
        t_start: float,
    ) -> None:
        """Serve one request as a pair (the reply goes to ``conn``)."""
        request = PdRequest(self, conn, key, request_id, label, parsed, prepared, t_start)
        conn.in_flight = request
        # Listed with the gateway's exchanges: stop() drains it, the sweep times it out.
        self.gw.exchanges[key] = request  # type: ignore[assignment]
        request.task = self.gw.spawn(request.run())
