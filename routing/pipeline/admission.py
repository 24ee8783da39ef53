"""Admission control: when a worker is too busy to take more, and what a request does when
every worker is.

A worker is *busy* (``Busy.of``) when any threshold an operator set is reached: requests the
gateway has in flight on it (``--max-in-flight-per-worker``), its active KV blocks as a share
of its KV capacity (``--busy-kv-fraction``; workers that report a capacity), or its prefill
tokens waiting (``--busy-prefill-tokens``). The load read is the gateway's own accounting
plus what the engine's own load report holds beyond it (``routing.placement.active_load``):
other gateways' requests count too where engines publish their load.

When every candidate is busy the request waits in a bounded queue (``AdmissionQueue``,
``--queue-timeout-s``, ``--queue-max``): highest ``x-kvsidecar-priority`` first; within a
priority, by the tenants' fair shares (``--queue-order fair``, the default) or first come,
first served (``fcfs``). Whenever a request ends (and every ``_RECHECK_S`` while any waits,
for load reports and workers that join) the queue's head is placed again; it leaves when
placed, when its client goes away, or at its deadline, answered 503 with ``retry-after``.
While any request waits, a new one waits too: a free worker goes to the queue's head, not to
whoever arrives first. Nothing is dropped without an answer, and every refusal says why in
``x-kvsidecar-shed-reason`` (``SHED_*``).

Fair shares are start-time fair queuing over tokens: each request is charged its prompt
plus ``max_tokens`` (``Waiter.cost``), divided by its tenant's weight (the API key file's
``weight=`` column). It is tagged ``start = max(virtual time, its tenant's last finish)``,
its tenant's finish moves to ``start + cost / weight``, and the queue serves the smallest
start first; the virtual time is the start of the last one served. A tenant that floods
queues behind itself, and one that sends little finds its requests near the head: under
overload each backlogged tenant gets its weighted share of the tokens served, whatever its
number of clients. A full queue sheds the request that ranks last (lowest priority, then
latest start) when the newcomer ranks ahead of it, so the flooding tenant's newest request
is the one refused (429 ``fair_share``), not a quiet tenant's.

Prefix-aware dispatch (``--queue-lookahead N``, a prefix policy): a slot that frees goes to
a waiting request whose prefix that worker holds, not to the head wherever its prefix lives.
The head is offered it first, on the condition that no busy worker holds markedly more of
its prefix than the free one it would get (``Admit.ELSEWHERE`` otherwise); then the next
``N`` requests of the head's priority band, in order, on the same condition; when none fits,
the head goes to the best free worker, as without look-ahead. So a freed slot is never left
idle while requests wait, priority bands are kept, and fair order bends only within the
window: the head is passed over at most ``N`` times, then placed wherever there is room.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routing.placement.active_load import ActiveLoad
from routing.vocabulary import QueueOrder

__all__ = [
    "PRIORITY_HEADER",
    "SHED_BUSY",
    "SHED_FAIR_SHARE",
    "SHED_HEADER",
    "SHED_QUEUE_FULL",
    "SHED_QUEUE_TIMEOUT",
    "SHED_RATE_LIMIT",
    "AdmissionQueue",
    "Admit",
    "Busy",
    "Waiter",
    "parse_priority",
]

_RECHECK_S = 0.05
PRIORITY_HEADER = b"x-kvsidecar-priority"
_PRIORITY_RANGE = (-1000, 1000)

# Why a request was refused for load, in ``x-kvsidecar-shed-reason`` (with ``retry-after``).
SHED_HEADER = b"x-kvsidecar-shed-reason"
SHED_BUSY = b"busy"  # every worker busy, no queue (--queue-timeout-s 0)
SHED_QUEUE_FULL = b"queue_full"  # --queue-max requests waiting, none ranking after it
SHED_QUEUE_TIMEOUT = b"queue_timeout"  # waited --queue-timeout-s
SHED_FAIR_SHARE = b"fair_share"  # shed from a full queue for a request ranking ahead of it
SHED_RATE_LIMIT = b"rate_limit"  # its tenant's requests or tokens per second


@dataclass(frozen=True, slots=True)
class Busy:
    """The thresholds that make a worker busy (None: that one is off)."""

    max_in_flight: int | None = None
    kv_fraction: float | None = None
    prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight-per-worker must be >= 1, got {self.max_in_flight}")
        if self.kv_fraction is not None and not 0 < self.kv_fraction <= 1:
            raise ValueError(f"--busy-kv-fraction must be in (0, 1], got {self.kv_fraction}")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"--busy-prefill-tokens must be >= 1, got {self.prefill_tokens}")

    @property
    def any(self) -> bool:
        return (self.max_in_flight, self.kv_fraction, self.prefill_tokens) != (None,) * 3

    def of(self, load: ActiveLoad, worker_ids: Sequence[str]) -> list[str]:
        """The busy ones of ``worker_ids``."""
        cap, fraction, prefill = self.max_in_flight, self.kv_fraction, self.prefill_tokens
        if cap is not None and fraction is None and prefill is None:  # the gateway's count
            return [w for w in worker_ids if load.in_flight_on(w) >= cap]
        busy = []
        for worker_id, wl in zip(worker_ids, load.loads(worker_ids, ()), strict=True):
            if ((cap is not None and load.in_flight_on(worker_id) >= cap)
                    or (prefill is not None and wl.active_prefill_tokens >= prefill)
                    or (fraction is not None and wl.capacity_blocks
                        and wl.decode_blocks >= fraction * wl.capacity_blocks)):
                busy.append(worker_id)
        return busy

    def describe(self) -> str:
        """What made the workers busy, for the client's error message."""
        parts = []
        if self.max_in_flight is not None:
            parts.append(f"{self.max_in_flight} requests in flight")
        if self.kv_fraction is not None:
            parts.append(f"{self.kv_fraction:.0%} of KV capacity active")
        if self.prefill_tokens is not None:
            parts.append(f"{self.prefill_tokens} prefill tokens queued")
        return " or ".join(parts)


def parse_priority(raw: bytes | None) -> int:
    """``x-kvsidecar-priority``: an integer (higher is served first), 0 when absent."""
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"x-kvsidecar-priority must be an integer, got {raw[:32]!r}") from None
    low, high = _PRIORITY_RANGE
    if not low <= value <= high:
        raise ValueError(f"x-kvsidecar-priority must be within [{low}, {high}], got {value}")
    return value


class Admit(enum.Enum):
    """What a waiting request's try to be placed came to."""

    PLACED = "placed"  # it left the queue: placed, or answered
    BUSY = "busy"  # every worker it may go to is busy
    # (asked to keep its prefix) a worker is free, but a busy one holds markedly more of it
    ELSEWHERE = "elsewhere"


class Waiter(Protocol):
    """A request waiting for a worker (``routing.pipeline.exchange.Exchange``)."""

    priority: int
    tenant: str  # its API key's tenant ("" without keys)
    weight: float  # its tenant's share weight
    cost: int  # tokens it asks for: prompt + max_tokens
    done: bool

    def admit_waiting(self, keep_prefix: bool = False) -> Admit:
        """Try to place it now; with ``keep_prefix``, only where no busy worker holds
        markedly more of its prefix (``Admit.ELSEWHERE`` otherwise)."""
        ...

    def wait_expired(self, waited_s: float) -> None:
        """Its deadline passed: answer it (503 with ``retry-after``)."""
        ...

    def wait_shed(self, tenant_ahead: str) -> None:
        """Shed from a full queue for a request of ``tenant_ahead``'s: answer it (429)."""
        ...


@dataclass(order=True, slots=True)
class _Entry:
    rank: tuple[int, float, int]  # (-priority, start tag, arrival): the smallest goes first
    since: float = field(compare=False)  # when it was queued, on the queue's clock
    finish: float = field(compare=False)  # its tenant's finish tag once it was queued
    waiter: Waiter = field(compare=False)
    passed_over: int = field(default=0, compare=False)  # as the head, by the look-ahead


class AdmissionQueue:
    """Requests waiting for a worker, bounded in number and in time.

    ``order``: within a priority, by tenants' fair shares or first come, first served.
    ``lookahead``: how many requests behind the head a freed slot may go to, for their
    prefix (module docstring; 0: always the head; >= 0, ``--queue-lookahead``'s bound).
    ``clock``: what waits are timed by (seconds; default: the running loop's clock)."""

    def __init__(self, timeout_s: float, max_waiting: int,
                 order: QueueOrder = QueueOrder.FAIR,
                 clock: Callable[[], float] | None = None, lookahead: int = 0) -> None:
        if timeout_s <= 0 or max_waiting < 1:
            raise ValueError("the admission queue needs timeout_s > 0 and max_waiting >= 1")
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self.order = order
        self.lookahead = lookahead
        self._clock = clock
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._virtual = 0.0  # the start tag of the request served last
        self._finish: dict[str, float] = {}  # tenant → finish tag of its latest request
        self._pass: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.num_queued = self.num_admitted = self.num_expired = self.num_full = 0
        self.num_shed = 0  # waiting requests shed for newcomers ranking ahead (fair_share)
        self.num_for_prefix = 0  # admitted ahead of the head, to the worker holding its prefix

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait."""
        return max(1, math.ceil(self.timeout_s))

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, waiter: Waiter) -> bool:
        """Queue ``waiter``; False (not queued) when the queue is full of requests that rank
        ahead of it. A full queue sheds its last for a newcomer that ranks ahead of that."""
        start = finish = 0.0
        if self.order is QueueOrder.FAIR:
            start = max(self._virtual, self._finish.get(waiter.tenant, 0.0))
            finish = start + waiter.cost / waiter.weight
        loop = asyncio.get_running_loop()
        since = loop.time() if self._clock is None else self._clock()
        entry = _Entry((-waiter.priority, start, next(self._seq)), since, finish, waiter)
        heap = self._heap
        if len(heap) >= self.max_waiting:
            last = max(heap)
            if self.order is QueueOrder.FCFS or not entry < last:
                self.num_full += 1
                return False
            heap.remove(last)
            heapq.heapify(heap)
            self._refund(last)
            self.num_shed += 1
            last.waiter.wait_shed(waiter.tenant)
        if self.order is QueueOrder.FAIR:
            self._finish[waiter.tenant] = finish
        heapq.heappush(heap, entry)
        self.num_queued += 1
        self._arm(loop)
        return True

    def wake(self) -> None:
        """Something ended: try the head again, soon (once per loop pass)."""
        if self._heap and self._pass is None:
            self._pass = asyncio.get_running_loop().call_soon(self._run)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(_RECHECK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._run()

    def _refund(self, entry: _Entry) -> None:
        """A request that leaves unserved gives its tenant back its charge, where it was
        that tenant's latest (an earlier one's charge is spent: later tags build on it)."""
        tenant = entry.waiter.tenant
        if self._finish.get(tenant) == entry.finish:
            self._finish[tenant] = entry.rank[1]

    def _run(self) -> None:
        """Place from the head while workers take them; expire what waited too long."""
        self._pass = None
        heap, loop = self._heap, asyncio.get_running_loop()
        now = loop.time() if self._clock is None else self._clock()
        while heap:
            entry = heap[0]
            if entry.waiter.done:  # its client went away
                heapq.heappop(heap)
                self._refund(entry)
                continue
            outcome, entry = self._admit_one(entry)
            if outcome is not Admit.PLACED:
                break
            if entry is heap[0]:
                heapq.heappop(heap)
            else:
                heap.remove(entry)
                heapq.heapify(heap)
            self._virtual = max(self._virtual, entry.rank[1])
            self.num_admitted += 1
        if heap:  # expire anywhere in the queue, not only at the head
            kept = []
            for entry in heap:
                waited = now - entry.since
                if entry.waiter.done:
                    self._refund(entry)
                elif waited >= self.timeout_s:
                    self.num_expired += 1
                    self._refund(entry)
                    entry.waiter.wait_expired(waited)
                else:
                    kept.append(entry)
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heap = kept
        if self._heap:
            self._arm(loop)
        else:  # idle: no tenant is behind any other any more
            self._finish.clear()

    def _admit_one(self, head: _Entry) -> tuple[Admit, _Entry]:
        """Place the head, or with look-ahead one behind it whose prefix a free worker
        holds (module docstring); what came of it, and which entry it was."""
        if not self.lookahead or head.passed_over >= self.lookahead:
            return head.waiter.admit_waiting(), head
        outcome = head.waiter.admit_waiting(keep_prefix=True)
        if outcome is not Admit.ELSEWHERE:
            return outcome, head
        for entry in heapq.nsmallest(self.lookahead + 1, self._heap)[1:]:
            if entry.rank[0] != head.rank[0]:
                break  # a lower priority band: never ahead of the head
            if entry.waiter.done:
                continue
            if entry.waiter.admit_waiting(keep_prefix=True) is Admit.PLACED:
                head.passed_over += 1
                self.num_for_prefix += 1
                return Admit.PLACED, entry
        return head.waiter.admit_waiting(), head

    def close(self) -> None:
        for handle in (self._pass, self._timer):
            if handle is not None:
                handle.cancel()
        self._pass = self._timer = None
