"""Admission control: when a worker is too busy to take more, and what a request does when
every worker is.

A worker is *busy* (``Busy.of``) when any threshold an operator set is reached: requests the
gateway has in flight on it (``--max-in-flight-per-worker``), its active KV blocks as a share
of its KV capacity (``--busy-kv-fraction``; workers that report a capacity), or its prefill
tokens waiting (``--busy-prefill-tokens``). The load read is the gateway's own accounting
plus what the engine's own load report holds beyond it (``routing.placement.active_load``):
other gateways' requests count too where engines publish their load.

When every candidate is busy the request waits in a bounded queue (``AdmissionQueue``,
``--queue-timeout-s``, ``--queue-max``): highest ``x-kvsidecar-priority`` first, first come
first served within a priority. Whenever a request ends (and every ``_RECHECK_S`` while any
waits, for load reports and workers that join) the queue's head is placed again; it leaves
when placed, when its client goes away, or at its deadline, answered 503 with
``retry-after``. A full queue answers 429 with ``retry-after`` at once. Nothing is dropped
without an answer.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from routing.placement.active_load import ActiveLoad

__all__ = ["PRIORITY_HEADER", "AdmissionQueue", "Busy", "Waiter", "parse_priority"]

_RECHECK_S = 0.05
PRIORITY_HEADER = b"x-kvsidecar-priority"
_PRIORITY_RANGE = (-1000, 1000)


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


class Waiter(Protocol):
    """A request waiting for a worker (``routing.pipeline.exchange.Exchange``)."""

    priority: int
    done: bool

    def admit_waiting(self) -> bool:
        """Try to place it now: True if it left the queue (placed, or answered)."""
        ...

    def wait_expired(self, waited_s: float) -> None:
        """Its deadline passed: answer it (503 with ``retry-after``)."""
        ...


class AdmissionQueue:
    """Requests waiting for a worker, bounded in number and in time.

    ``clock``: what waits are timed by (seconds; default: the running loop's clock)."""

    def __init__(self, timeout_s: float, max_waiting: int,
                 clock: Callable[[], float] | None = None) -> None:
        if timeout_s <= 0 or max_waiting < 1:
            raise ValueError("the admission queue needs timeout_s > 0 and max_waiting >= 1")
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._clock = clock
        self._heap: list[tuple[int, int, float, Waiter]] = []  # (-priority, seq, since, w)
        self._seq = itertools.count()
        self._pass: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.num_queued = self.num_admitted = self.num_expired = self.num_full = 0

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait."""
        return max(1, math.ceil(self.timeout_s))

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, waiter: Waiter) -> bool:
        """Queue ``waiter``; False (not queued) when the queue is full."""
        if len(self._heap) >= self.max_waiting:
            self.num_full += 1
            return False
        loop = asyncio.get_running_loop()
        since = loop.time() if self._clock is None else self._clock()
        heapq.heappush(self._heap, (-waiter.priority, next(self._seq), since, waiter))
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

    def _run(self) -> None:
        """Place from the head while workers take them; expire what waited too long."""
        self._pass = None
        heap, loop = self._heap, asyncio.get_running_loop()
        now = loop.time() if self._clock is None else self._clock()
        while heap:
            waiter = heap[0][3]
            if waiter.done:  # its client went away
                heapq.heappop(heap)
                continue
            if not waiter.admit_waiting():
                break
            heapq.heappop(heap)
            self.num_admitted += 1
        if heap:  # expire anywhere in the queue, not only at the head
            kept = []
            for entry in heap:
                waited = now - entry[2]
                if entry[3].done:
                    continue
                if waited >= self.timeout_s:
                    self.num_expired += 1
                    entry[3].wait_expired(waited)
                else:
                    kept.append(entry)
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heap = kept
        if self._heap:
            self._arm(loop)

    def close(self) -> None:
        for handle in (self._pass, self._timer):
            if handle is not None:
                handle.cancel()
        self._pass = self._timer = None
