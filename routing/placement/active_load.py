"""Active-load bookkeeping: what the gateway has in flight on each worker.

Per worker: prefill tokens not yet prefilled, KV blocks held by active requests, and the
request count. The lifecycle of a request, as the gateway sees it::

    add (on dispatch) → first_token (prefill done) → tokens_generated* → finish (or abort)

Prefill tokens are the request's *uncached* prompt tokens; they count until its first token.
Prompt blocks of requests on the same worker that share a prefix count once (refcounted, as an
engine's prefix cache shares them); generated tokens add a block each time they cross a block
boundary. Everything is released on finish.

A worker whose engine publishes its own load (``EngineLoad``, on its sidecar's status every
half second) may carry more than the gateway sent it: other gateways' requests, clients that
reach the engine directly, a queue the gateway cannot see. At each reading the surplus of the
engine's figures over the gateway's own is kept (``set_engine_load``) and added to every
load the scorer reads until the next reading: the gateway's live count stays exact for what
it sent, the engine's reading covers the rest. Placement does no extra work per request for
it (the surplus is computed per reading, not per request); a reading lags by up to one
status interval, so requests that ended in that window may count until the next one.

To tell a candidate how many of a new request's blocks it already holds actively, the
refcounts themselves are searched: every active request holds a whole prefix of its chain
and hashes are chained, so a worker's active set is prefix-closed and "block i is active"
is monotone in i — a binary search over the request's blocks finds the depth.

An ``observer`` (``interference.py``), when set, is told each streamed request's gaps
between tokens with the worker's requests in flight at the time, and each finished request's
output tokens: what decode interference is learned from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcore.stream import EngineLoad
from routing.placement.scorer import WorkerLoad

__all__ = ["RESERVED_MARK", "ActiveLoad", "TokenObserver", "UnknownRequestError"]

RESERVED_MARK = "~"  # leads the key of a reservation (``ActiveLoad.reserve``)


class TokenObserver(Protocol):
    """What the gateway's token timings feed (``interference.DecodeInterference``)."""

    # The clock the gaps are timed by: called on each chunk, so an attribute (the injected
    # callable itself), not a method wrapping it.
    clock: Callable[[], float]

    def token_gap(self, worker_id: str, in_flight: int, gap_s: float, tokens: int) -> None:
        """``tokens`` more tokens of a stream on ``worker_id``, ``gap_s`` apart on average,
        while it had ``in_flight`` requests."""

    def finished(self, output_tokens: int) -> None:
        """A request ended having streamed ``output_tokens``."""


class UnknownRequestError(KeyError):
    """A lifecycle call for a request id that is not in flight."""


@dataclass(slots=True)
class _Request:
    worker_id: str
    block_hashes: Sequence[int]
    prompt_tokens: int
    prefill_tokens: int  # uncached prompt tokens, until the first token
    output_tokens: int = 0
    output_blocks: int = 0
    last_token_at: float | None = None  # when its last tokens came (with an observer)


@dataclass(slots=True)
class _WorkerTotals:
    prefill_tokens: int = 0
    output_blocks: int = 0
    in_flight: int = 0
    capacity_blocks: int | None = None
    # What the engine's last reading holds beyond the gateway's own count (set_engine_load).
    engine_prefill_tokens: int = 0
    engine_blocks: int = 0
    engine_in_flight: int = 0


class ActiveLoad:
    """In-flight requests per worker and the load figures the scorer needs."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._workers: dict[str, _WorkerTotals] = {}
        self._refs: dict[str, dict[int, int]] = {}  # worker → active prompt block → refcount
        self.on_first_token: Callable[[str], None] | None = None  # feedback (tuning.py)
        self.observer: TokenObserver | None = None  # token timings (interference.py)

    # --- lifecycle ----------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        worker_id: str,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        cached_tokens: int = 0,
    ) -> None:
        """A request was dispatched to ``worker_id`` with ``cached_tokens`` predicted cached."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        prefill = max(0, prompt_tokens - cached_tokens)
        self._requests[request_id] = _Request(worker_id, block_hashes, prompt_tokens, prefill)
        totals = self._totals(worker_id)
        totals.prefill_tokens += prefill
        totals.in_flight += 1
        refs = self._refs.setdefault(worker_id, {})
        for block in block_hashes:
            refs[block] = refs.get(block, 0) + 1

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: its prefill tokens no longer load the worker."""
        request = self._get(request_id)
        self._workers[request.worker_id].prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0
        if self.on_first_token is not None:
            self.on_first_token(request_id)

    def tokens_generated(self, request_id: str, count: int = 1) -> None:
        """The request produced ``count`` more tokens (its KV grows by whole blocks)."""
        request = self._get(request_id)
        if request.prefill_tokens:
            self.first_token(request_id)
        request.output_tokens += count
        total = request.prompt_tokens + request.output_tokens
        blocks = total // self.block_size - request.prompt_tokens // self.block_size
        totals = self._workers[request.worker_id]
        totals.output_blocks += blocks - request.output_blocks
        request.output_blocks = blocks
        observer = self.observer
        if observer is not None and count > 0:
            now = observer.clock()
            last = request.last_token_at
            if last is not None:
                observer.token_gap(request.worker_id, totals.in_flight + totals.engine_in_flight,
                                   (now - last) / count, count)
            request.last_token_at = now

    def finish(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): release everything it held."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        totals = self._workers[request.worker_id]
        totals.prefill_tokens -= request.prefill_tokens
        totals.output_blocks -= request.output_blocks
        totals.in_flight -= 1
        if self.observer is not None and request.output_tokens:
            self.observer.finished(request.output_tokens)
        refs = self._refs[request.worker_id]
        for block in request.block_hashes:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]

    def reserve(self, key: str, worker_id: str, block_hashes: Sequence[int],
                prompt_tokens: int) -> None:
        """Count a request that is not dispatched yet as if it were, on ``worker_id``, until
        ``unreserve``: a held new prompt proposed there (routing/replicas/prompt_hold.py), so
        that the next proposals weigh it. ``key`` starts with ``RESERVED_MARK``; a subclass
        that shares its load does not share this (the class's own ``add``)."""
        ActiveLoad.add(self, key, worker_id, block_hashes, prompt_tokens)

    def unreserve(self, key: str) -> None:
        """The reservation ``reserve`` made (if still there: its worker may have left)."""
        if key in self._requests:
            ActiveLoad.finish(self, key)

    def finish_if_known(self, request_id: str) -> None:
        """``finish``, for a request whose worker may have left meanwhile (its accounting
        went with it: ``forget_worker``)."""
        if request_id in self._requests:
            self.finish(request_id)

    # --- queries ------------------------------------------------------------------------

    def set_capacity(self, worker_id: str, capacity_blocks: int | None) -> None:
        self._totals(worker_id).capacity_blocks = capacity_blocks

    def set_engine_load(self, worker_id: str, load: EngineLoad | None) -> None:
        """The engine's own reading of the worker (None: none, or no longer): what it holds
        beyond the gateway's own count now counts as load until the next reading."""
        totals = self._totals(worker_id)
        if load is None:
            totals.engine_prefill_tokens = totals.engine_blocks = totals.engine_in_flight = 0
            return
        own_blocks = len(self._refs.get(worker_id, ())) + totals.output_blocks
        engine_blocks = -(-load.kv_used_tokens // self.block_size)
        totals.engine_blocks = max(0, engine_blocks - own_blocks)
        totals.engine_prefill_tokens = max(0, load.queued_prefill_tokens - totals.prefill_tokens)
        totals.engine_in_flight = max(0, load.running + load.queued - totals.in_flight)

    def load(self, worker_id: str, block_hashes: Sequence[int] = ()) -> WorkerLoad:
        """The worker's load, with ``block_hashes`` (a new request) counted as if added."""
        return self.loads([worker_id], block_hashes)[0]

    def loads(self, worker_ids: Sequence[str], block_hashes: Sequence[int]) -> list[WorkerLoad]:
        """``load`` for each worker, with ``block_hashes`` counted as if added there."""
        out = []
        for worker_id in worker_ids:
            totals = self._workers.get(worker_id)
            if totals is None:
                out.append(WorkerLoad(decode_blocks=len(block_hashes)))
                continue
            refs = self._refs.get(worker_id, {})
            out.append(
                WorkerLoad(
                    active_prefill_tokens=totals.prefill_tokens + totals.engine_prefill_tokens,
                    decode_blocks=len(refs)
                    + totals.output_blocks
                    + totals.engine_blocks
                    + len(block_hashes)
                    - _active_depth(refs, block_hashes),
                    in_flight=totals.in_flight + totals.engine_in_flight,
                    capacity_blocks=totals.capacity_blocks,
                )
            )
        return out

    def in_flight_on(self, worker_id: str) -> int:
        """Requests in flight on ``worker_id``."""
        totals = self._workers.get(worker_id)
        return 0 if totals is None else totals.in_flight

    def worker_of(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return None if request is None else request.worker_id

    def in_flight(self) -> int:
        return len(self._requests)

    def forget_worker(self, worker_id: str) -> list[str]:
        """Drop a dead worker's accounting; returns the request ids that were on it."""
        lost = [rid for rid, r in self._requests.items() if r.worker_id == worker_id]
        for rid in lost:
            del self._requests[rid]
        self._workers.pop(worker_id, None)
        self._refs.pop(worker_id, None)
        return lost

    # --- internals ----------------------------------------------------------------------

    def _get(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequestError(request_id)
        return request

    def _totals(self, worker_id: str) -> _WorkerTotals:
        totals = self._workers.get(worker_id)
        if totals is None:
            totals = self._workers[worker_id] = _WorkerTotals()
        return totals


def _active_depth(refs: dict[int, int], block_hashes: Sequence[int]) -> int:
    """How many leading blocks of the request are active (prefix-closed: binary search)."""
    n = len(block_hashes)
    if not n or not refs or block_hashes[0] not in refs:
        return 0
    if block_hashes[n - 1] in refs:
        return n
    lo, hi = 1, n - 1  # block lo-1 is active, block hi is not
    while lo < hi:
        mid = (lo + hi) >> 1
        if block_hashes[mid] in refs:
            lo = mid + 1
        else:
            hi = mid
    return lo
