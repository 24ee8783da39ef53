"""Active-load bookkeeping: what the gateway has in flight on each worker.

Per worker: prefill tokens not yet prefilled, KV blocks held by active requests, and the
request count. The lifecycle of a request, as the gateway sees it::

    add (on dispatch) → first_token (prefill done) → tokens_generated* → finish (or abort)

Prefill tokens are the request's *uncached* prompt tokens; they count until its first token.
Prompt blocks of requests on the same worker that share a prefix count once (refcounted, as an
engine's prefix cache shares them); generated tokens add a block each time they cross a block
boundary. Everything is released on finish.

To tell a candidate how many of a new request's blocks it already holds actively, active
prompt blocks are kept in a private ``PrefixIndex`` (each worker's active set is a union of
whole prefixes, so the index's binary-search match applies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adapters.canonical.events import BlockRemoved, BlockStored, Tier
from routing.prefix_index import PrefixIndex
from routing.scorer import WorkerLoad

__all__ = ["ActiveLoad", "UnknownRequestError"]


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


@dataclass(slots=True)
class _WorkerTotals:
    prefill_tokens: int = 0
    output_blocks: int = 0
    in_flight: int = 0
    seq: int = 0  # event sequence of this worker in the private active-block index
    capacity_blocks: int | None = None


class ActiveLoad:
    """In-flight requests per worker and the load figures the scorer needs."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._workers: dict[str, _WorkerTotals] = {}
        self._refs: dict[str, dict[int, int]] = {}  # worker → active prompt block → refcount
        self._active = PrefixIndex()  # active prompt blocks, for "already active" matching

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
        new = []
        for block in block_hashes:
            count = refs.get(block, 0)
            refs[block] = count + 1
            if not count:
                new.append(block)
        if new:
            totals.seq += 1
            self._active.apply(BlockStored(worker_id, 0, totals.seq, Tier.GPU, new))

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: its prefill tokens no longer load the worker."""
        request = self._get(request_id)
        self._workers[request.worker_id].prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0

    def tokens_generated(self, request_id: str, count: int = 1) -> None:
        """The request produced ``count`` more tokens (its KV grows by whole blocks)."""
        request = self._get(request_id)
        if request.prefill_tokens:
            self.first_token(request_id)
        request.output_tokens += count
        total = request.prompt_tokens + request.output_tokens
        blocks = total // self.block_size - request.prompt_tokens // self.block_size
        self._workers[request.worker_id].output_blocks += blocks - request.output_blocks
        request.output_blocks = blocks

    def finish(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): release everything it held."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        totals = self._workers[request.worker_id]
        totals.prefill_tokens -= request.prefill_tokens
        totals.output_blocks -= request.output_blocks
        totals.in_flight -= 1
        refs = self._refs[request.worker_id]
        gone = []
        for block in request.block_hashes:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                gone.append(block)
        if gone:
            totals.seq += 1
            self._active.apply(BlockRemoved(request.worker_id, 0, totals.seq, Tier.GPU, gone))

    # --- queries ------------------------------------------------------------------------

    def set_capacity(self, worker_id: str, capacity_blocks: int | None) -> None:
        self._totals(worker_id).capacity_blocks = capacity_blocks

    def load(self, worker_id: str, block_hashes: Sequence[int] = ()) -> WorkerLoad:
        """The worker's load, with ``block_hashes`` (a new request) counted as if added."""
        return self.loads([worker_id], block_hashes)[0]

    def loads(self, worker_ids: Sequence[str], block_hashes: Sequence[int]) -> list[WorkerLoad]:
        """``load`` for many workers with one match of the request's blocks."""
        matched = self._active.match(block_hashes) if block_hashes else {}
        out = []
        for worker_id in worker_ids:
            totals = self._workers.get(worker_id)
            if totals is None:
                out.append(WorkerLoad(decode_blocks=len(block_hashes)))
                continue
            active = len(self._refs.get(worker_id, ()))
            out.append(
                WorkerLoad(
                    active_prefill_tokens=totals.prefill_tokens,
                    decode_blocks=active
                    + totals.output_blocks
                    + len(block_hashes)
                    - matched.get(worker_id, 0),
                    in_flight=totals.in_flight,
                    capacity_blocks=totals.capacity_blocks,
                )
            )
        return out

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
        self._active.remove_worker(worker_id)
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
