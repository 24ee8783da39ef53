"""Moving a request's cached prefix to this worker, from the worker that holds it.

The gateway places a request on a lighter worker than the one holding its prefix when the
holder's load outweighs the prefix (``routing.placement.kv_move``), and names the holder in
the request (``TokenizedRequest.prefix_source``). Before the request goes to the engine,
this sidecar pulls the prefix's blocks from the holder's block store into its own with the
transfer service the prefill/decode handoff uses (shm on one host, NIXL across hosts, TCP
where NIXL is absent); the engine then finds them through its storage hook, as it finds
any block of its host tier, and prefills only the rest.

Requests of one hot prefix come in bursts: while a pull of a prefix runs, another request
moved here with the same prefix joins it (one pull, the engine started on each only once the
blocks are here) instead of finding the blocks reserved and the engine recomputing them.

A failed pull (the holder gone, its store evicted the blocks, no room here, a timeout) is a
recompute: the request goes to the engine all the same, which prefills the whole prompt.
Nothing partial becomes visible (the transfer service commits all or nothing). Either way
the answer says what happened in ``x-kvsidecar-kv-pull``, which the gateway learns the
pull's speed from and counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from kvcore.requests import PrefixSource

if TYPE_CHECKING:
    from sidecar.transfer import BlockTransferService

__all__ = ["PULL_HEADER", "MoveOutcome", "PrefixPuller"]

log = structlog.get_logger(component="kv_move")

PULL_HEADER = "x-kvsidecar-kv-pull"


@dataclass(frozen=True, slots=True)
class MoveOutcome:
    """What one pull of a prefix did: blocks held here now (pulled or already held), the
    bytes moved, how long it took, and the failure's code (None: it worked)."""

    blocks: int
    num_bytes: int
    seconds: float
    error: str | None = None

    def header(self) -> str:
        """The ``x-kvsidecar-kv-pull`` value (``routing.placement.kv_move.parse_pull``)."""
        outcome = "ok" if self.error is None else f"failed:{self.error}"
        return (f"outcome={outcome} blocks={self.blocks} bytes={self.num_bytes} "
                f"seconds={self.seconds:.6f}")


class PrefixPuller:
    """Pulls moved prefixes into this sidecar's store (None: it has no store, so every
    move fails, and the engine recomputes)."""

    def __init__(self, transfer: BlockTransferService | None,
                 on_outcome: Callable[[MoveOutcome], None] | None = None) -> None:
        self._transfer = transfer
        self._on_outcome = on_outcome
        # Pulls running, by (holder, prefix): a request with the same prefix joins one.
        self._flights: dict[tuple[str, tuple[int, ...]], asyncio.Task[MoveOutcome]] = {}

    async def pull(self, source: PrefixSource, request_id: str) -> MoveOutcome:
        """Bring ``source``'s prefix here; never raises for a failed transfer. A request
        that joins another's pull reports no blocks of its own (nothing moved for it)."""
        key = (source.peer_url, tuple(source.block_hashes))
        flight = self._flights.get(key)
        if flight is not None:
            started = time.perf_counter()
            joined = await asyncio.shield(flight)
            outcome = MoveOutcome(0, 0, time.perf_counter() - started, joined.error)
        else:
            flight = asyncio.ensure_future(self._pull(source, request_id))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
            outcome = await asyncio.shield(flight)  # a cancelled request leaves it running
        if self._on_outcome is not None:
            self._on_outcome(outcome)
        return outcome

    async def _pull(self, source: PrefixSource, request_id: str) -> MoveOutcome:
        from sidecar.transfer import TransferError, TransportUnavailableError  # noqa: PLC0415

        started = time.perf_counter()
        transfer = self._transfer
        if transfer is None:
            return self._failed("no_store", "this sidecar has no block store to pull into",
                                request_id, started)
        transport = source.transport
        try:
            try:
                result = await transfer.pull_named(source.peer_url, source.block_hashes,
                                                   transport=transport,
                                                   timeout_s=source.timeout_s)
            except TransportUnavailableError:
                if transport != "nixl":
                    raise
                transport = "tcp"  # across hosts without NIXL: the TCP block stream
                left = max(0.001, source.timeout_s - (time.perf_counter() - started))
                result = await transfer.pull_named(source.peer_url, source.block_hashes,
                                                   transport=transport, timeout_s=left)
        except TransferError as exc:
            return self._failed(exc.code, str(exc), request_id, started)
        blocks = len(result.imported) + len(result.already_held)
        outcome = MoveOutcome(blocks, result.num_bytes, time.perf_counter() - started)
        log.debug("kv_prefix_moved", request_id=request_id, peer_url=source.peer_url,
                  blocks=blocks, transport=transport, seconds=round(outcome.seconds, 6))
        return outcome

    def _failed(self, code: str, why: str, request_id: str, started: float) -> MoveOutcome:
        log.info("kv_prefix_move_failed", request_id=request_id, code=code, error=why)
        return MoveOutcome(0, 0, time.perf_counter() - started, code)
