"""KV handoff for prefill/decode disaggregation: how a decode sidecar gets a request's blocks.

The decode sidecar calls ``KvHandoff.pull(prefill_url, page_keys, ...)`` after the prefill
worker answered with the first token and the keys of the prompt's pages, and before its
engine imports those pages through its storage hook. Two implementations:

* ``SharedPageStoreHandoff``: the two engines' hooks share one page store (the reference
  engine's ``file`` backend on one host, or any store both can reach). Nothing moves here;
  the decode engine's import is the check, and a page it cannot import fails the request
  with a 409 that the caller reports as a failed transfer.
* ``TransferServiceHandoff``: the engines' hooks are backed by their own sidecar's
  shared-memory store (``adapters/sglang/hicache.py``); the decode sidecar pulls the blocks
  from the prefill sidecar's store into its own with ``BlockTransferService`` (shm on one host,
  NIXL across hosts, TCP when NIXL is unavailable), keyed exactly as the hook keys them
  (the adapter's ``PrefillDecode.store_keys``).

Every failure is a ``HandoffError`` with a message that says what went wrong; nothing partial
becomes visible (the transfer service commits all or nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from adapters.base import PrefillDecode
from sidecar.config import HandoffKind, SidecarConfig

if TYPE_CHECKING:
    from sidecar.transfer import BlockTransferService

__all__ = [
    "HandoffError",
    "HandoffKind",
    "HandoffResult",
    "KvHandoff",
    "SharedPageStoreHandoff",
    "SimulatedTransportHandoff",
    "TransferServiceHandoff",
    "make_handoff",
]


class HandoffError(RuntimeError):
    """The blocks could not be brought to this worker (the request cannot decode here)."""


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """What one handoff moved."""

    blocks: int
    num_bytes: int
    seconds: float
    transport: str


class KvHandoff(Protocol):
    """Brings the pages named by ``page_keys`` from the prefill sidecar to this one."""

    kind: HandoffKind

    async def pull(
        self, peer_url: str, page_keys: Sequence[str], *, transport: str, timeout_s: float
    ) -> HandoffResult: ...


class SharedPageStoreHandoff:
    """The engines share their page store: the pages are already where the decode engine
    looks for them; its import verifies them."""

    kind = HandoffKind.SHARED_STORE

    async def pull(
        self, peer_url: str, page_keys: Sequence[str], *, transport: str, timeout_s: float
    ) -> HandoffResult:
        return HandoffResult(len(page_keys), 0, 0.0, HandoffKind.SHARED_STORE.value)


class SimulatedTransportHandoff:
    """A handoff that takes as long as a transport of ``ms_per_1k_tokens`` would (for the
    simulated engines, whose pages hold no bytes), then defers to ``inner``."""

    def __init__(self, inner: KvHandoff, ms_per_1k_tokens: float, page_size: int) -> None:
        self.kind = inner.kind
        self._inner = inner
        self._s_per_token = ms_per_1k_tokens / 1e6
        self._page_size = page_size

    async def pull(
        self, peer_url: str, page_keys: Sequence[str], *, transport: str, timeout_s: float
    ) -> HandoffResult:
        started = time.perf_counter()
        await asyncio.sleep(len(page_keys) * self._page_size * self._s_per_token)
        moved = await self._inner.pull(peer_url, page_keys, transport=transport,
                                       timeout_s=timeout_s)
        return HandoffResult(moved.blocks, moved.num_bytes, time.perf_counter() - started,
                             f"simulated({moved.transport})")


class TransferServiceHandoff:
    """Pulls the pages from the prefill sidecar's block store into ours."""

    kind = HandoffKind.TRANSFER

    def __init__(
        self,
        service: BlockTransferService,
        store_keys: Callable[[Sequence[str]], list[tuple[int, int]]],
    ) -> None:
        self._service = service
        self._store_keys = store_keys

    async def pull(
        self, peer_url: str, page_keys: Sequence[str], *, transport: str, timeout_s: float
    ) -> HandoffResult:
        from sidecar.transfer import (  # noqa: PLC0415
            TransferError,
            TransportUnavailableError,
        )

        if not page_keys:
            return HandoffResult(0, 0, 0.0, transport)
        keys = self._store_keys(page_keys)
        started = time.perf_counter()
        try:
            try:
                result = await self._service.pull(
                    peer_url, keys, transport=transport, timeout_s=timeout_s
                )
            except TransportUnavailableError:
                if transport != "nixl":
                    raise
                transport = "tcp"  # across hosts without NIXL: the TCP block stream
                left = max(0.001, timeout_s - (time.perf_counter() - started))
                result = await self._service.pull(peer_url, keys, transport=transport,
                                                  timeout_s=left)
        except TransferError as exc:
            raise HandoffError(
                f"pulling {len(keys)} blocks from {peer_url} over {transport} failed: {exc}"
            ) from exc
        blocks = len(result.imported) + len(result.already_held)
        return HandoffResult(blocks, result.num_bytes, time.perf_counter() - started, transport)


def make_handoff(
    cfg: SidecarConfig,
    pd: PrefillDecode | None,
    transfer: BlockTransferService | None,
    model_id: str,
    block_size: int,
) -> KvHandoff:
    """The handoff ``--kv-handoff`` names (and ``--sim-handoff-ms-per-1k-tokens`` slows)."""
    handoff: KvHandoff = SharedPageStoreHandoff()
    if cfg.kv_handoff == HandoffKind.TRANSFER and pd is not None:
        assert transfer is not None  # the config requires a block store
        handoff = TransferServiceHandoff(transfer, lambda keys: pd.store_keys(model_id, keys))
    if cfg.sim_handoff_ms_per_1k_tokens:
        handoff = SimulatedTransportHandoff(handoff, cfg.sim_handoff_ms_per_1k_tokens, block_size)
    return handoff
