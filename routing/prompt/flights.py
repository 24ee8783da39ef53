"""Long prompt texts being tokenized off the event loop, so that each is tokenized once.

A burst of requests that share a new system prompt (each with its own user turn) all meet
it uncached, so each would tokenize it in a worker thread (``TokenizeLater``): on a loaded
machine 64 such requests tokenized the same 4,000-token prompt 64 times, and the burst's
last request reached its worker 0.5 s after it arrived. The first request to need a text
leads its flight; the others wait for it and then prepare again, finding its pieces in the
tokenizer's cache. A wait changes when a request is prepared, never its tokens: the
follower prepares from scratch, and tokenizes whatever is still uncached itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["TokenizeFlights"]

FlightKey = tuple[str, bool]  # ``TokenizeLater.share_key``: text, add_special_tokens


class TokenizeFlights:
    """The texts being tokenized off the loop now, each with what its followers wait on."""

    def __init__(self) -> None:
        self._flights: dict[FlightKey, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def pending(self, key: FlightKey) -> asyncio.Future[None] | None:
        """What to wait on when ``key`` is being tokenized (``asyncio.shield`` it: one
        follower's cancellation must not wake the others early); None: lead it."""
        return self._flights.get(key)

    @contextmanager
    def lead(self, key: FlightKey) -> Iterator[None]:
        """Tokenize ``key`` (and cache it) inside; its followers wake when it is left,
        however it is left (a failure too: they then tokenize it themselves)."""
        if key in self._flights:
            raise RuntimeError("a tokenizing flight is already led for this text")
        flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            yield
        finally:
            del self._flights[key]
            if not flight.done():
                flight.set_result(None)
