"""What a simulated replica publishes, stamped with the simulated time it happened.

Two closed unions, one per channel the gateway hears a replica on:

* ``KvNote``: the replica's KV events (blocks stored, blocks removed), which reach the router
  after the sidecar's delay;
* ``StreamNote``: what the gateway sees on a request's own stream (the first token, the output
  crossing a trace block, the finish).

Ids are trace ids (the trace's chained prefix hashes); requests are named by their trace index.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FirstToken",
    "KvNote",
    "Removed",
    "RequestFinished",
    "Stored",
    "StreamNote",
    "TokensGenerated",
]


@dataclass(frozen=True, slots=True)
class Stored:
    """A chain of trace ids is cached; the first hangs under ``parent`` (None: the root)."""

    at: float
    ids: list[int]
    parent: int | None


@dataclass(frozen=True, slots=True)
class Removed:
    """These trace ids were evicted."""

    at: float
    ids: list[int]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Request ``index`` produced its first output token."""

    at: float
    index: int


@dataclass(frozen=True, slots=True)
class TokensGenerated:
    """Request ``index`` has produced ``total`` output tokens (sent at trace-block crossings)."""

    at: float
    index: int
    total: int


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """Request ``index`` is done."""

    at: float
    index: int


KvNote = Stored | Removed
StreamNote = FirstToken | TokensGenerated | RequestFinished
