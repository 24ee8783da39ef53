"""Prefill/decode disaggregation in the gateway: pools, pair placement, backpressure, metrics.

Sidecars say which pool their worker serves (``--role agg|prefill|decode``, carried on their
event stream into the worker registry). When the fleet has both prefill and decode workers,
the gateway serves each tokenized request as a *pair*:

* the prefill worker is scored by overlap and prefill load (``Pool.PREFILL``: uncached prompt
  blocks plus the prefill already queued there);
* the decode worker by how full its KV would be (``Pool.DECODE``: decode blocks over the
  capacity its sidecar reports), among the workers with room for the request's prompt and
  ``max_tokens`` (reserved while it runs).

No decode worker with room: the request *waits* (backpressure) until one frees up, for at
most ``--pd-queue-timeout-s``; then it gets 503 with ``retry-after``. Nothing is dropped. No
pair is a ``Refusal`` (``routing.placement.refusal``), as no worker is for the place stage:
``busy`` when waiting for room may help, else the 503 the client gets.

How the pair shares the KV (``--pd-mode``): ``auto`` hands it over between our sidecars
(``Handoff``: the decode sidecar drives the prefill leg and pulls the blocks); ``sglang``
uses the engine's own transfer (``Bootstrap``: both workers get the request with one room,
as SGLang's router does). ``--kv-load-failure-policy``: a failed handoff either fails the
request (502, ``kv_transfer_failed``) or re-runs it on an aggregated worker. The request's
way through the gateway is the pipeline's (``routing.pipeline``).

Aggregated requests never go to prefill or decode workers (the registry's pools).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcore.errors import SERVICE_UNAVAILABLE
from kvcore.requests import Bootstrap, Handoff
from routing.config import FailurePolicy, PdMode  # re-exported: the config owns them
from routing.placement.kv_router import KvRouter
from routing.placement.refusal import Refusal
from routing.placement.scorer import Placement, Pool
from routing.prompt.preparer import PreparedPrompt
from routing.vocabulary import pull_transport
from routing.workers.registry import Role, Worker, WorkerRegistry

__all__ = ["DEFAULT_RESERVE_TOKENS", "FailurePolicy", "PdCoordinator", "PdMetrics", "PdMode",
           "PdPair"]

DEFAULT_RESERVE_TOKENS = 256  # decode room reserved for a request without max_tokens
_WAKE_S = 0.5  # a waiting request looks again at least this often (capacity may grow)
_rng = random.SystemRandom()


@dataclass(frozen=True, slots=True)
class PdPair:
    """The two workers of one disaggregated request and their placements."""

    prefill: Worker
    decode: Worker
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
        p = "kvsidecar_gateway_"
        for name, doc, value in (
            ("pd_requests", "Requests served by a prefill/decode pair", self.requests),
            ("pd_completed", "Disaggregated requests answered in full", self.completed),
            ("pd_backpressure_waits", "Requests that waited for room in the decode pool",
             self.backpressure_waits),
            ("pd_backpressure_rejects",
             "Requests answered 503 after --pd-queue-timeout-s without room",
             self.backpressure_rejects),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, doc, label, table in (
            ("kv_transfer_failures", "KV handoffs that failed or timed out, by failure policy",
             "policy", self.transfer_failures),
            ("pd_fallbacks", "Failed handoffs re-run aggregated (rerun) or left without an "
             "aggregated worker (no_worker)", "outcome", self.fallbacks),
        ):
            c = CounterMetricFamily(p + name, doc, labels=[label])
            for key, n in table.items():
                c.add_metric([key], n)
            yield c
        yield GaugeMetricFamily(p + "pd_waiting", "Requests waiting for room in the decode "
                                "pool now", value=self.waiting)


class PdCoordinator:
    """Which requests go to a pair, which pair, and how the pair shares the KV."""

    def __init__(
        self,
        router: KvRouter,
        workers: WorkerRegistry,
        *,
        mode: PdMode,
        policy: FailurePolicy,
        queue_timeout_s: float,
        transfer_timeout_s: float,
        kv_transport: str,
    ) -> None:
        self.router = router
        self.workers = workers
        self.mode = mode
        self.policy = policy
        self.queue_timeout_s = queue_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_transport = kv_transport
        self.metrics = PdMetrics()
        self._reserved: dict[str, int] = {}  # decode worker → blocks reserved by its requests
        self._freed = asyncio.Event()

    def takes(self, prompt: PreparedPrompt) -> bool:
        """Serve this request as a pair? (PD on, tokenized, and both pools present.)"""
        if self.mode is PdMode.OFF or prompt.token_ids is None:
            return False
        return bool(self.workers.routable(Role.PREFILL)) and bool(
            self.workers.routable(Role.DECODE)
        )

    def reserve_blocks(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """Decode blocks a request may come to hold: its prompt and all its output."""
        out = DEFAULT_RESERVE_TOKENS if max_tokens is None else max_tokens
        return math.ceil((prompt_tokens + out) / self.router.block_size)

    # --- pair placement ----------------------------------------------------------------------

    def place(self, prompt: PreparedPrompt, max_tokens: int | None) -> PdPair | Refusal:
        """A pair now, or why there is none: a ``busy`` refusal when every decode worker
        that could ever hold the request is full now (waiting for room may help:
        ``place_waiting``), else the 503 the client gets."""
        need = self.reserve_blocks(prompt.prompt_tokens, max_tokens)
        prefills = self.workers.routable(Role.PREFILL)
        decodes = self.workers.routable(Role.DECODE)
        if not prefills or not decodes:
            return _unavailable("no prefill or no decode worker is available")
        hashes, tokens = prompt.block_hashes, prompt.prompt_tokens
        prefill = self.router.place(hashes, tokens, [w.worker_id for w in prefills],
                                    pool=Pool.PREFILL)
        roomy = [w.worker_id for w in decodes if self._has_room(w, need)]
        decode = self.router.place(hashes, tokens, roomy, pool=Pool.DECODE) if roomy else None
        if prefill is not None and decode is not None:
            self._reserved[decode.worker_id] = self._reserved.get(decode.worker_id, 0) + need
            by_id = {w.worker_id: w for w in (*prefills, *decodes)}
            return PdPair(by_id[prefill.worker_id], by_id[decode.worker_id], prefill, decode,
                          need)
        if not any(_fits_ever(w, need) for w in decodes):
            return _unavailable(f"the request needs {need} KV blocks for its prompt and "
                                "max_tokens; no decode worker has that many")
        return Refusal(503, _full(need), SERVICE_UNAVAILABLE, busy=True, retry_after_s=1)

    async def place_waiting(self, prompt: PreparedPrompt,
                            max_tokens: int | None) -> PdPair | Refusal:
        """``place``, waiting for room in the decode pool up to ``--pd-queue-timeout-s``
        (never a ``busy`` refusal)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        self.metrics.backpressure_waits += 1
        self.metrics.waiting += 1
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    self.metrics.backpressure_rejects += 1
                    need = self.reserve_blocks(prompt.prompt_tokens, max_tokens)
                    return _unavailable(f"{_full(need)}; waited {self.queue_timeout_s:g}s, "
                                        "retry later")
                try:
                    await asyncio.wait_for(self._freed.wait(), timeout=min(left, _WAKE_S))
                except TimeoutError:
                    pass
                placed = self.place(prompt, max_tokens)
                if not (isinstance(placed, Refusal) and placed.busy):
                    return placed
        finally:
            self.metrics.waiting -= 1

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

    def _has_room(self, worker: Worker, need: int) -> bool:
        capacity = worker.capacity_blocks
        return capacity is None or self._reserved.get(worker.worker_id, 0) + need <= capacity

    # --- how the pair shares the KV ------------------------------------------------------------

    def handoff(self, pair: PdPair) -> Handoff:
        """What the decode sidecar is told of the prefill side (``--pd-mode auto``)."""
        transport = pull_transport(self.kv_transport, pair.prefill.address.host,
                                   pair.decode.address.host)
        return Handoff(
            prefill_url=pair.prefill.address.url,
            prefill_dp_rank=pair.prefill.dp_rank,
            transport=transport,  # type: ignore[arg-type]  # checked by RouterConfig
            transfer_timeout_s=self.transfer_timeout_s,
            # Without a fallback nothing waits on the handoff's outcome: the first token is
            # streamed as soon as the prefill has it, a failure ends the stream with an error.
            early_first_token=self.policy is FailurePolicy.FAIL,
        )

    def bootstrap(self, pair: PdPair) -> tuple[Bootstrap, Bootstrap] | Refusal:
        """Both legs' ``Bootstrap`` (``--pd-mode sglang``), or why the prefill worker has none."""
        address = pair.prefill.bootstrap
        if address is None:
            return _unavailable(f"prefill worker {pair.prefill.worker_id} does not serve its "
                                "engine's own KV transfer (its sidecar reported no bootstrap "
                                "address)")
        host, port = address
        room = _rng.getrandbits(63)
        return Bootstrap("prefill", host, port, room), Bootstrap("decode", host, port, room)


def _unavailable(why: str) -> Refusal:
    """No pair now: 503, retry in a second."""
    return Refusal(503, why, SERVICE_UNAVAILABLE, retry_after_s=1)


def _full(need: int) -> str:
    return f"every decode worker is full (the request needs {need} KV blocks)"


def _fits_ever(worker: Worker, need: int) -> bool:
    capacity = worker.capacity_blocks
    return capacity is None or need <= capacity

