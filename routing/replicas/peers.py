"""The other gateway replicas, as heard over NATS, folded into this replica's router.

Pure and synchronous, with an injected clock: ``apply`` takes one decoded batch of a peer,
``expire`` drops the peers gone silent. A peer's placements become its load here (through
``SharedLoad``'s ``*_remote`` calls) and its placed prefixes speculative prefixes on their
worker (``PendingPrefixes``, with this router's TTL), as do the new prompts it claims for
this replica (``Claimed``), so a request with the same prefix arriving here next goes where
the peer's went. A peer silent past the timeout (a dead
gateway, or one cut from NATS) has all its load dropped: nothing phantom stays behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import assert_never

import structlog

from routing.placement.kv_router import KvRouter
from routing.replicas.messages import Claimed, Finished, FirstToken, Placed, ReplicaBatch
from routing.replicas.shared_load import REMOTE_MARK, SharedLoad

__all__ = ["RemotePeers"]

log = structlog.get_logger("routing.replicas", component="gateway")


@dataclass(slots=True)
class _Peer:
    prefix: str  # of its keys here: "@<replica>/"
    last_seen_s: float
    seq: int = 0
    keys: set[str] = field(default_factory=set)  # its requests in flight, as keyed here
    resync_asked_s: float | None = None  # a snapshot asked for and not seen yet


def _ignore(peer_ids: list[str]) -> None:
    return None


class RemotePeers:
    """Every peer's sequence, liveness and requests in flight."""

    def __init__(
        self,
        router: KvRouter,
        load: SharedLoad,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._load = load
        self.timeout_s = timeout_s
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        # Called with the live peers' ids whenever one joins or is dropped.
        self.on_change: Callable[[list[str]], None] = _ignore
        self.num_batches = 0
        self.num_gaps = 0  # batches after a missed one (each may ask for a snapshot)
        self.num_lost = 0  # peers dropped for silence
        self._last_expire_s: float | None = None  # when ``expire`` last ran

    def __len__(self) -> int:
        return len(self._peers)

    def apply(self, batch: ReplicaBatch) -> bool:
        """Fold one peer's batch in; True when that peer should be asked for a snapshot."""
        now = self._clock()
        rid = batch.replica_id
        peer = self._peers.get(rid)
        if peer is None:
            peer = self._peers[rid] = _Peer(f"{REMOTE_MARK}{rid}/", now)
            log.info("replica_peer_joined", replica_id=rid)
            self.on_change(list(self._peers))
        self.num_batches += 1
        peer.last_seen_s = now
        ask = False
        if batch.snapshot:
            self._drop_requests(peer)
            peer.resync_asked_s = None
        elif batch.seq != peer.seq + 1:
            self.num_gaps += 1
            asked = peer.resync_asked_s
            ask = asked is None or now - asked > self.timeout_s
            if ask:
                peer.resync_asked_s = now
        peer.seq = batch.seq
        if batch.events:
            self._fold(peer, batch, now)
        return ask

    def expire(self) -> list[str]:
        """Drop the peers silent for ``timeout_s``, with their load; their ids.

        Called at least every third of ``timeout_s`` (the link's heartbeat). A gap past half
        of it since the last call means this replica was stalled (paused, starved): what the
        peers sent meanwhile waits unread, so that silence is this replica's, not theirs, and
        their leases are moved on by the stall instead of being dropped for it.
        """
        now = self._clock()
        last, self._last_expire_s = self._last_expire_s, now
        if last is not None and now - last > self.timeout_s / 2:
            stalled_s = now - last
            log.warning("replica_stalled", stalled_s=round(stalled_s, 3), peers=len(self._peers))
            for peer in self._peers.values():
                peer.last_seen_s = min(now, peer.last_seen_s + stalled_s)
        limit = now - self.timeout_s
        gone = [rid for rid, p in self._peers.items() if p.last_seen_s < limit]
        for rid in gone:
            peer = self._peers.pop(rid)
            log.warning("replica_peer_lost", replica_id=rid, requests=len(peer.keys),
                        silent_s=round(now - peer.last_seen_s, 3))
            self._drop_requests(peer)
            self.num_lost += 1
        if gone:
            self.on_change(list(self._peers))
        return gone

    def _fold(self, peer: _Peer, batch: ReplicaBatch, now: float) -> None:
        load, keys, prefix = self._load, peer.keys, peer.prefix
        pending = None if batch.snapshot else self._router.pending
        for event in batch.events:
            match event:
                case Placed():
                    key = prefix + event.key
                    if load.add_remote(key, event):
                        keys.add(key)
                        if pending is not None:
                            pending.record(event.worker_id, event.block_hashes, now)
                case FirstToken():
                    load.first_token_remote(prefix + event.key)
                case Finished():
                    key = prefix + event.key
                    load.finish_remote(key)
                    keys.discard(key)
                case Claimed():  # the peer's answer to a held new prompt: where it goes
                    self._router.pending.record(event.worker_id, event.block_hashes, now)
                case _:
                    assert_never(event)

    def _drop_requests(self, peer: _Peer) -> None:
        finish = self._load.finish_remote
        for key in peer.keys:
            finish(key)
        peer.keys.clear()
