"""Load figures of the requests this sidecar proxies, per worker.

In-flight requests; active KV blocks (each request's prompt plus generated tokens, in whole
blocks); queued prefill tokens (prompts that have not produced a first token yet). Published
in every ``LoadReport`` and at ``GET /v1/load``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadTracker", "WorkerLoadFigures"]


@dataclass(slots=True)
class WorkerLoadFigures:
    in_flight: int = 0
    active_tokens: int = 0  # prompt + generated tokens of in-flight requests
    queued_prefill_tokens: int = 0


@dataclass(slots=True)
class _Flight:
    worker_id: str
    prompt_tokens: int
    generated: int = 0
    prefilled: bool = False


class LoadTracker:
    """Request lifecycle → per-worker load figures."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._flights: dict[str, _Flight] = {}
        self._workers: dict[str, WorkerLoadFigures] = {}
        self.completed = 0
        self.failed = 0
        self.generated = 0  # tokens the engine produced, all requests: its work advancing

    def start(self, request_id: str, worker_id: str, prompt_tokens: int) -> None:
        if request_id in self._flights:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._flights[request_id] = _Flight(worker_id, prompt_tokens)
        w = self._figures(worker_id)
        w.in_flight += 1
        w.active_tokens += prompt_tokens
        w.queued_prefill_tokens += prompt_tokens

    def tokens(self, request_id: str, count: int) -> None:
        """``count`` more tokens were generated (the first one ends the prefill)."""
        flight = self._flights.get(request_id)
        if flight is None or count <= 0:
            return
        w = self._workers[flight.worker_id]
        if not flight.prefilled:
            flight.prefilled = True
            w.queued_prefill_tokens -= flight.prompt_tokens
        flight.generated += count
        w.active_tokens += count
        self.generated += count

    def finish(self, request_id: str, ok: bool = True) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        w = self._workers[flight.worker_id]
        w.in_flight -= 1
        w.active_tokens -= flight.prompt_tokens + flight.generated
        if not flight.prefilled:
            w.queued_prefill_tokens -= flight.prompt_tokens
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    def figures(self, worker_id: str) -> WorkerLoadFigures:
        return self._figures(worker_id)

    def active_blocks(self, worker_id: str) -> int:
        """Whole blocks held by the worker's in-flight requests (each rounded up)."""
        bs = self.block_size
        return sum(
            -(-(f.prompt_tokens + f.generated) // bs)
            for f in self._flights.values()
            if f.worker_id == worker_id
        )

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def _figures(self, worker_id: str) -> WorkerLoadFigures:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = WorkerLoadFigures()
        return w
