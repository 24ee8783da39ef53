"""This gateway's link to the other replicas over NATS (``--nats``).

Core NATS publish/subscribe, no JetStream: what is shared is live in-flight state, which a
durable stream would only replay stale. Subjects, under the prefix (``--nats-subject-prefix``,
default ``kvsidecar.<model>``)::

    <prefix>.load.<replica_id>   each replica's batches (it subscribes to <prefix>.load.*)
    <prefix>.resync              "replica X, publish a snapshot"
    <prefix>.claim               "replica X, place these new prompts" (X owns them; the
                                 asker holds a session of each: prompt_hold.py)

One publisher task sends each event-loop tick's events (``SharedLoad.outbox``) as one batch,
so the request path only appends to a list; with nothing to say for a heartbeat interval
(a third of ``--nats-peer-timeout-s``) it sends an empty batch, and it drops the peers gone
silent. On every (re)connect, and when a peer asks, it sends a snapshot instead. While NATS
is unreachable the gateway serves alone: events are dropped and counted, nats-py reconnects
for ever, and the peers, having dropped this replica's load, get a snapshot on return.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog

from kvcore import nats_extra
from kvcore.wire import WireError
from routing.config import RouterConfig
from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare
from routing.replicas.messages import (
    AskedPrompt,
    Claimed,
    ClaimRequest,
    ReplicaBatch,
    ReplicaEvent,
    ResyncRequest,
    decode_batch,
    decode_claim,
    decode_resync,
    encode,
)
from routing.replicas.metrics import ReplicaMetrics
from routing.replicas.peers import RemotePeers
from routing.replicas.prompt_hold import PromptHold
from routing.replicas.shared_load import SharedLoad

__all__ = ["ReplicaLink", "default_subject_prefix"]

log = structlog.get_logger("routing.replicas", component="gateway")

R = TypeVar("R", ResyncRequest, ClaimRequest)



def default_subject_prefix(model_names: Sequence[str]) -> str:
    """``kvsidecar.<first model name>`` (made a valid subject token), or ``kvsidecar``."""
    if not model_names:
        return "kvsidecar"
    return "kvsidecar." + (re.sub(r"[^A-Za-z0-9_-]", "_", model_names[0]) or "model")


class ReplicaLink:
    """Publishes this replica's placements, folds in the others' (``RemotePeers``)."""

    def __init__(
        self,
        router: KvRouter,
        load: SharedLoad,
        *,
        url: str,
        subject_prefix: str,
        peer_timeout_s: float,
        new_prompt_window_s: float = 0.05,
        replica_id: str | None = None,
    ) -> None:
        self._nats = nats_extra.load("kvsidecar gateway --nats")
        self.replica_id = replica_id or os.urandom(6).hex()
        self.url = url
        self._load = load
        self.peers = RemotePeers(router, load, timeout_s=peer_timeout_s)
        self.peers.on_change = self._peers_changed
        self._share = router.peer_share = PeerShare(self.replica_id)
        self.hold = PromptHold(router, self._share, new_prompt_window_s)
        self.hold.ask_owner = self._ask_to_claim
        # the prompts to ask each owner to place (``ClaimRequest``), by its replica id
        self._claims_due: dict[str, list[AskedPrompt]] = {}
        self.heartbeat_s = peer_timeout_s / 3
        self.subject = f"{subject_prefix}.load.{self.replica_id}"
        self._all_subjects = f"{subject_prefix}.load.*"
        self._resync_subject = f"{subject_prefix}.resync"
        self._claim_subject = f"{subject_prefix}.claim"
        self._wake = asyncio.Event()
        load.on_outbox = self._wake.set
        self._seq = 0
        self._snapshot_due = True
        self._nc: Any = None
        self.metrics = m = ReplicaMetrics()
        m.peers = self.peers.__len__
        m.remote_requests = lambda: load.num_remote
        m.peers_lost = lambda: self.peers.num_lost
        m.gaps = lambda: self.peers.num_gaps
        m.spread = lambda: self._share.num_spread
        m.held = lambda: self.hold.num_held
        m.held_followed = lambda: self.hold.num_followed
        m.held_claimed = lambda: self.hold.num_claimed
        m.held_timed_out = lambda: self.hold.num_timed_out
        m.claims = lambda: self.hold.num_claims

    @classmethod
    def for_gateway(cls, cfg: RouterConfig, router: KvRouter, load: SharedLoad) -> ReplicaLink:
        assert cfg.nats_url is not None  # built only with --nats
        prefix = cfg.nats_subject_prefix or default_subject_prefix(cfg.model_names)
        return cls(router, load, url=cfg.nats_url, subject_prefix=prefix,
                   peer_timeout_s=cfg.nats_peer_timeout_s,
                   new_prompt_window_s=cfg.nats_new_prompt_window_ms / 1000)

    async def run(self) -> None:
        """Connect (retrying for ever) and publish, until cancelled; then close."""
        nc = self._nc = self._nats.NATS()
        log.info("replica_link_starting", replica_id=self.replica_id, url=self.url,
                 subject=self.subject)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._connect(nc))
                tasks.create_task(self._publish_loop(nc))
        finally:
            await nats_extra.close_quietly(self._nats, nc, log)

    # --- connection ----------------------------------------------------------------------

    async def _connect(self, nc: Any) -> None:
        await nats_extra.connect(
            nc, self.url, f"kvsidecar-gateway-{self.replica_id}",
            error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_connected,
        )
        await nc.subscribe(self._all_subjects, cb=self._on_batch)
        await nc.subscribe(self._resync_subject, cb=self._on_resync)
        await nc.subscribe(self._claim_subject, cb=self._on_claim)
        await self._on_connected()

    async def _on_connected(self) -> None:
        log.info("nats_connected", replica_id=self.replica_id, url=self.url)
        self.metrics.connected = True
        self._snapshot_due = True  # the peers may have dropped this replica meanwhile
        self._wake.set()

    async def _on_disconnected(self) -> None:
        if self.metrics.connected:
            self.metrics.connected = False
            self.metrics.disconnects += 1
            log.warning("nats_disconnected", replica_id=self.replica_id, url=self.url)

    async def _on_error(self, exc: Exception) -> None:
        m = self.metrics
        m.nats_errors += 1
        if m.nats_errors == 1 or m.connected:  # once per outage, not once per retry
            log.warning("nats_unreachable", url=self.url, error=repr(exc),
                        serving="alone until it returns")

    def _peers_changed(self, peer_ids: list[str]) -> None:
        joined = len(peer_ids) > self._share.count - 1
        self._share.set_peers(peer_ids)
        self.hold.heard()  # a held prompt's owner may have changed
        if joined:  # tell the newcomer about this replica now, not at the next heartbeat
            self._snapshot_due = True
            self._wake.set()

    # --- publishing ----------------------------------------------------------------------

    async def _publish_loop(self, nc: Any) -> None:
        load, wake = self._load, self._wake
        while True:
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await wake.wait()
            except TimeoutError:
                pass  # nothing to say: a heartbeat
            wake.clear()
            self.peers.expire()
            events = load.outbox
            if events:
                load.outbox = []
            if not nc.is_connected:
                self.metrics.events_dropped += len(events)
                continue
            if self._snapshot_due:
                self._snapshot_due = False
                self.metrics.snapshots_published += 1
                # every request in flight, and this tick's claims (no requests: not in it)
                claims = [event for event in events if type(event) is Claimed]
                await self._send(nc, [*load.snapshot(), *claims], True)
            else:
                await self._send(nc, events, False)
            if self._claims_due:
                await self._ask_claims(nc)

    def _ask_to_claim(self, replica_id: str, prompt: AskedPrompt) -> None:
        self._claims_due.setdefault(replica_id, []).append(prompt)
        self._wake.set()

    async def _ask_claims(self, nc: Any) -> None:
        asks, self._claims_due = self._claims_due, {}
        for replica_id, prompts in asks.items():
            try:
                await nc.publish(self._claim_subject, encode(ClaimRequest(replica_id, prompts)))
            except self._nats.errors.Error as exc:  # the holds end at their limit instead
                log.warning("replica_claim_not_asked", replica_id=replica_id,
                            prompts=len(prompts), error=repr(exc))

    async def _send(self, nc: Any, events: list[ReplicaEvent], snapshot: bool) -> None:
        """Publish ``events`` as one batch (split in halves past the server's payload
        limit)."""
        frame = encode(ReplicaBatch(self.replica_id, self._seq + 1, snapshot, events))
        if len(frame) > nc.max_payload and len(events) > 1:
            half = len(events) // 2
            await self._send(nc, events[:half], snapshot)
            await self._send(nc, events[half:], False)
            return
        try:
            await nc.publish(self.subject, frame)
        except self._nats.errors.Error as exc:
            self.metrics.events_dropped += len(events)
            self._snapshot_due = True
            log.warning("replica_batch_dropped", events=len(events), error=repr(exc))
            return
        self._seq += 1
        self.metrics.batches_published += 1
        self.metrics.events_published += len(events)

    # --- receiving -----------------------------------------------------------------------

    async def _on_batch(self, msg: Any) -> None:
        if msg.subject == self.subject:
            return  # our own
        try:
            batch = decode_batch(msg.data)
        except WireError as exc:
            self.metrics.batches_rejected += 1
            log.warning("replica_batch_rejected", subject=msg.subject, raw_len=len(msg.data),
                        error=str(exc))
            return
        if batch.replica_id == self.replica_id:
            return
        self.metrics.batches_received += 1
        ask = self.peers.apply(batch)
        self.hold.heard()
        if ask:
            self.metrics.resyncs_asked += 1
            try:
                await self._nc.publish(self._resync_subject,
                                       encode(ResyncRequest(batch.replica_id)))
            except self._nats.errors.Error as exc:
                log.warning("replica_resync_not_asked", replica_id=batch.replica_id,
                            error=repr(exc))

    async def _on_resync(self, msg: Any) -> None:
        if self._asked_of_me(msg, decode_resync, "replica_resync_rejected"):
            self._snapshot_due = True
            self._wake.set()

    async def _on_claim(self, msg: Any) -> None:
        """A peer holds sessions of new prompts this replica owns: place each (the next
        batch carries the answers; routing/replicas/prompt_hold.py)."""
        request = self._asked_of_me(msg, decode_claim, "replica_claim_rejected")
        if request is None:
            return
        for prompt in request.prompts:
            worker_id = self.hold.claim(prompt)
            if worker_id is not None:
                self._load.claimed(worker_id, prompt.block_hashes)

    def _asked_of_me(
        self, msg: Any, decode: Callable[[bytes], R], rejected: str
    ) -> R | None:
        """``msg``, a peer's request to one replica, if it names this one (a bad frame is
        counted and logged as ``rejected``)."""
        try:
            request = decode(msg.data)
        except WireError as exc:
            self.metrics.batches_rejected += 1
            log.warning(rejected, raw_len=len(msg.data), error=str(exc))
            return None
        return request if request.replica_id == self.replica_id else None
