"""The block store owner: segment, store core and control server in one asyncio object.

``async with BlockStoreOwner(config, listener=...) as owner:`` unlinks stale segments of a
dead owner with the same id, creates and pre-faults the segment, and serves clients on the
Unix socket until the block exits, when it drops every client and unlinks the segment and
the socket. The sidecar embeds it in its own loop; ``python -m shm`` is a thin shell.

Each connection is one store session (``shm.owner._connection``). Frames are handled
synchronously (the store core is pure and fast): one-way frames (``Release``, ``Publish``)
as soon as they are read, a request once every connection readable in the same wake-up has
been read (``wait_turn``: one ``call_soon`` hop, skipped when only one client is
connected). So whatever one-way frame reached the owner before a request was sent is
applied before that request, and so is every commit a writer made by publishing its slots
in the read index (``shm.owner._client_cells``; while reservations are open the owner also polls
for those, every millisecond or so, for their events): a block whose ``put_many`` has
returned is visible to every later request, and a lease given back is evictable.
When a connection closes, however the client died, the frames it had sent are applied,
then its reservations are freed and its leases released. After each request the store's
events go to ``listener``, a plain callable that must not block (the sidecar's puts them
on a bounded queue); an exception from it is logged and counted, never lost silently and
never fatal to the store.

With lower tiers (disk, remote: ``shm.owner.lower_tiers``), the blocks the store evicts go down
to them, and a lease that misses in shared memory promotes what they hold back into slots
first (the connection's reply deferred until the blocks are in): clients see one store,
through the same protocol.

Events name blocks canonically (``shm.block_names``): by their keys when clients key them
canonically (the default), else by the names the sidecar learns from the engine's events
(``BlockStoreOwner(..., names=BlockNames(..., canonical_keys=False))``), with which the
lower tiers keep them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import assert_never

import msgspec
import structlog

from kvcore.events import KVEvent
from shm.block_names import BlockNames
from shm.errors import (
    BlockStoreError,
    ClientDetachedError,
    OwnerConflictError,
    ProtocolError,
)
from shm.owner._client_cells import ClientCells
from shm.owner._connection import Connection
from shm.owner.config import OwnerConfig
from shm.owner.lower_tiers import LowerTiers
from shm.owner.store import BlockKey, BlockStore, SessionId, StoreStats
from shm.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Claim,
    Contains,
    Done,
    ErrorReply,
    Flags,
    Hello,
    Lease,
    Ping,
    Publish,
    Release,
    Remove,
    Request,
    Reserve,
    Slots,
    Stats,
    StatsReply,
    Welcome,
    decode_request,
    encode,
    is_one_way,
)
from shm.segment import Segment, unlink_stale_segments
from shm.tiers.disk_tier import DiskTier
from shm.tiers.remote_tier import RemoteTier

__all__ = ["BlockStoreOwner", "EventListener"]

log = structlog.get_logger(component="shm")

EventListener = Callable[[KVEvent], None]
_DONE = encode(Done())
# While reservations are open or standby grants out, the owner polls for writers' commits
# every _POLL_S, backing off to _POLL_MAX_S while none come (an event loop's timers tick in
# milliseconds); while a grant is offered, only once none came for _STANDBY_GRACE_NS, as a
# writer putting every few ms takes its grant between two polls.
_POLL_S = 0.001
_POLL_MAX_S = 0.064
_STANDBY_GRACE_NS = 50_000_000


class BlockStoreOwner:
    """Owns one segment and serves it; an async context manager."""

    def __init__(self, config: OwnerConfig, listener: EventListener | None = None,
                 names: BlockNames | None = None) -> None:
        self.config = config
        self._listener = listener
        # What the events call the blocks: their keys, unless the sidecar says otherwise.
        self.names = names or BlockNames(config.effective_worker_id)
        # Names learned ahead of their blocks' puts outlast a store's worth of those puts.
        self.names.capacity = max(self.names.capacity, 2 * config.num_slots)
        self.names.notify = self._names_came
        self._drain_soon = False  # a drain is scheduled for names that came late
        self.epoch = time.time_ns() // 1000
        self.segment: Segment | None = None
        self.store: BlockStore | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._welcome: Welcome | None = None
        self._cells: ClientCells | None = None  # each client's hits and publications
        self._bound = False
        self.num_listener_errors = 0
        self.num_rejected_releases = 0
        self.num_rejected_commits = 0  # one-way ``Publish`` frames that failed
        self._waiting: list[Connection] = []  # with a request queued for ``_run_waiting``
        self._poll: asyncio.TimerHandle | None = None  # see ``_poll_published``
        self._busy_ns = 0  # when the poll last found a commit or a grant taken
        self._loop: asyncio.AbstractEventLoop | None = None  # the one we serve in
        self.num_internal_errors = 0
        # The tiers below the store (``--disk-tier-dir``, ``--remote-tier-url``): evicted
        # blocks spill to them, and a lease that misses in shared memory promotes them back.
        self.lower_tiers = LowerTiers()

    @property
    def disk(self) -> DiskTier | None:
        return self.lower_tiers.of(DiskTier)

    @property
    def remote(self) -> RemoteTier | None:
        return self.lower_tiers.of(RemoteTier)

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> BlockStoreOwner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._claim_socket_path()
        unlink_stale_segments(cfg.owner_id)
        # Pre-faulting a large segment takes a while: keep it off the loop.
        self.segment = await asyncio.to_thread(
            Segment.create,
            cfg.owner_id,
            block_bytes=cfg.block_bytes,
            num_slots=cfg.num_slots,
            dtype=cfg.dtype,
            layout=cfg.layout,
        )
        try:
            self.store = BlockStore(
                cfg.num_slots,
                worker_id=cfg.effective_worker_id,
                generation_mirror=self.segment.generations,
                read_index=self.segment.index,
                max_granted=cfg.max_granted_slots,
            )
            self._cells = ClientCells(self.segment.index, self.store)
            await self.lower_tiers.start(cfg, self.store, self.segment.slots[:, : cfg.block_bytes],
                                         self.names, self.drain_events, lambda: self.store)
            self._welcome = Welcome(
                protocol_version=PROTOCOL_VERSION,
                owner_id=cfg.owner_id,
                worker_id=cfg.effective_worker_id,
                epoch=self.epoch,
                segment=self.segment.name,
                block_bytes=cfg.block_bytes,
                num_slots=cfg.num_slots,
                dtype=cfg.dtype,
                layout=cfg.layout,
            )
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: Connection(self), path=str(cfg.socket_path)
            )
            self._bound = True
            os.chmod(cfg.socket_path, 0o600)
        except BaseException:
            if self._server is not None:
                self._server.close()
                self._server = None
            if self._bound:
                self._bound = False
                cfg.socket_path.unlink(missing_ok=True)
            self.store = self._cells = None
            await self.lower_tiers.aclose()
            self._release_segment()
            raise
        log.info("shm_owner_started", owner_id=cfg.owner_id, socket=str(cfg.socket_path),
                 segment=self.segment.name, num_slots=cfg.num_slots,
                 block_bytes=cfg.block_bytes, epoch=self.epoch)
        self.drain_events()  # the disk tier's blocks, re-announced

    def _claim_socket_path(self) -> None:
        """Remove a socket file left by a dead owner; refuse one a live owner listens on."""
        path = self.config.socket_path
        if not path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            log.info("shm_socket_unlinked", socket=str(path), reason="stale")
            return
        except OSError as exc:
            raise OwnerConflictError(f"socket path {path} is in use and not a socket: "
                                     f"{exc}") from exc
        finally:
            probe.close()
        raise OwnerConflictError(f"another owner is listening on {path}")

    async def aclose(self) -> None:
        """Drop clients, record ``AllBlocksCleared``, unlink the segment and the socket."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.abort()
            await self._server.wait_closed()
            self._server = None
        await self.lower_tiers.finish_reads()  # they fill slots of the segment
        if self.store is not None:
            self.store.spill = self.store.committed = None
            await self.lower_tiers.aclose()  # a remote tier's queue is read from the slots
            self.store.clear()
            self.drain_events()
            # They hold views of the segment's generation table and read index.
            self.store = self._cells = None
        self.lower_tiers.forget_store()
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self._release_segment()
        if self._bound:  # never remove a socket file we did not create
            self._bound = False
            self.config.socket_path.unlink(missing_ok=True)
        log.info("shm_owner_stopped", owner_id=self.config.owner_id)

    def _release_segment(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None

    # ----------------------------------------------------------------- requests
    def stats(self) -> StoreStats:
        """The store's statistics, hits counting the clients' optimistic reads too."""
        if self.store is None or self._cells is None:
            raise RuntimeError("the owner is not started")
        self._cells.record_publications()
        stats = self.store.stats()
        optimistic = self._cells.optimistic_hits()
        stats = replace(stats, num_hits=stats.num_hits + optimistic,
                        num_optimistic_hits=optimistic)
        return self.lower_tiers.with_stats(stats)

    def keys_named(self, block_hashes: Sequence[int]) -> list[BlockKey]:
        """The store keys of the leading blocks of ``block_hashes`` (a prefix's canonical
        hashes, in order) held in shared memory now, up to the first one not held: what a
        peer sidecar pulls to move that prefix (``sidecar.transfer``)."""
        store = self.store
        if store is None:
            raise ClientDetachedError("the block store owner is not running")
        by_name = self.names.store_hashes_named(block_hashes)
        held = store.keys_of_hashes(set(by_name.values()))
        keys: list[BlockKey] = []
        for block_hash in block_hashes:
            store_hash = by_name.get(block_hash)
            key = None if store_hash is None else held.get(store_hash)
            if key is None:
                break
            keys.append(key)
        return keys

    def handle(self, session: SessionId, body: bytes, *, drain: bool = True,
               defer: bool = False) -> bytes | asyncio.Task[bytes] | None:
        """One request frame body → one reply frame (``None`` for one-way frames).

        ``drain=False`` leaves the store's events, and the books a reservation's reply does
        not need, for ``drain_events``: a connection sends the reply first, so neither the
        listener's work nor the bookkeeping is on the client's round trip. ``defer``: the
        caller takes a task whose result is the reply (a lease that reads a lower tier);
        without it, the disk is read before this returns (a remote tier misses).
        """
        store, cells = self.store, self._cells
        if store is None or cells is None:
            return encode(ErrorReply("client_detached", "the owner is shutting down"))
        try:
            msg = decode_request(body)
        except ProtocolError as exc:
            if is_one_way(body):  # the client waits for no reply: log, don't answer
                self._reject_one_way(session, body[1], exc)
                return None
            return encode(ErrorReply(exc.code, str(exc)))
        if not isinstance(msg, Release | Publish):
            # What writers committed by publishing is visible to every request that follows.
            cells.record_publications()
        try:
            reply = self._dispatch(store, session, msg, defer)
        except (BlockStoreError, ValueError) as exc:
            if isinstance(msg, Release | Publish):
                self._reject_one_way(session, body[1], exc)
                reply = None
            else:
                code = exc.code if isinstance(exc, BlockStoreError) else "protocol"
                reply = encode(ErrorReply(code, str(exc)))
        except Exception as exc:  # a bug of ours: answer, count, keep serving the others
            self.num_internal_errors += 1
            log.exception("shm_request_failed", session=session, request=type(msg).__name__)
            reply = None if isinstance(msg, Release | Publish) else encode(
                ErrorReply(BlockStoreError.code, f"internal error: {exc!r}"))
        if drain:
            self.drain_events()
        return reply

    def _dispatch(self, store: BlockStore, session: SessionId, msg: Request,
                  defer: bool) -> bytes | asyncio.Task[bytes] | None:
        match msg:
            case Reserve(namespaces, hashes, parents, tokens, grant, standby):
                keys = _keys(namespaces, hashes)
                slots, gens = store.reserve(session, keys, parents, tokens, standby=standby)
                return encode(Slots(slots, gens, *store.grant(session, grant)))
            case Claim(namespaces, hashes, slots, generations, parents, tokens, grant):
                keys = _keys(namespaces, hashes)
                got, gens = store.claim(session, keys, slots, generations, parents, tokens)
                # A slot whose key was held is still granted: list it again for the client.
                kept = [(s, g) for s, g, taken in zip(slots, generations, got, strict=True)
                        if taken is None]
                new_slots, new_gens = store.grant(session, grant)
                return encode(Slots(got, gens, [s for s, _ in kept] + new_slots,
                                    [g for _, g in kept] + new_gens))
            case Publish(slots, generations):
                store.commit(session, slots, generations)
                return None
            case Lease(namespaces, hashes):  # what shared memory misses is read below
                return self.lower_tiers.lease(store, session, _keys(namespaces, hashes), defer)
            case Release(slots, generations):
                store.release(session, slots, generations)
                return None
            case Abort(slots, generations):
                store.abort(session, slots, generations)
                return _DONE
            case Contains(namespaces, hashes):
                return encode(Flags(self.lower_tiers.contains(store, _keys(namespaces, hashes))))
            case Remove(namespaces, hashes):
                return encode(Flags(self.lower_tiers.remove(store, _keys(namespaces, hashes))))
            case Stats():
                return encode(StatsReply(self.stats()))
            case Ping():
                return _DONE
            case Hello(version, _pid):
                if version != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"client speaks protocol {version}, owner {PROTOCOL_VERSION}")
                assert self._welcome is not None  # set before the server accepts anyone
                cell = -1 if self._cells is None else self._cells.cell_of(session)
                return encode(msgspec.structs.replace(self._welcome, hit_cell=cell))
            case _:
                assert_never(msg)

    def _reject_one_way(self, session: SessionId, tag: int, exc: Exception) -> None:
        if tag == Publish.__struct_config__.tag:
            self.num_rejected_commits += 1
            log.warning("shm_publish_rejected", session=session, error=str(exc))
        else:
            self.num_rejected_releases += 1
            log.warning("shm_release_rejected", session=session, error=str(exc))

    def commit(self, session: SessionId, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Commit reserved slots of an in-process session (``shm.owner.local``), which needs the
        store's verdict (a stale descriptor raises here) and sends no frame; clients
        commit by publishing their slots in the read index, or with ``Publish``."""
        if self.store is None:
            raise ClientDetachedError("the owner is shutting down")
        self.store.commit(session, slots, generations)
        self.drain_events()

    def wait_turn(self, conn: Connection) -> bool:
        """Queue ``conn``'s request behind the other connections' one-way frames.

        ``False`` when no queueing is needed (``conn`` is the only connection).
        """
        if len(self._connections) <= 1:
            return False
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._run_waiting)
        self._waiting.append(conn)
        return True

    def _run_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for conn in waiting:
            conn.run_queued()

    def drain_events(self) -> None:
        """Settle the store's books (see ``BlockStore.reserve``) and hand its events to the
        listener: after a reply is sent, so neither is on the client's round trip. While
        reservations are open, poll for their writers' commits."""
        if self.store is None:
            return
        events = self.store.take_events()  # settles first
        self.store.offer_due()  # standby grants picked up: the next ones
        events += self.lower_tiers.take_events()
        if self._poll is None and self._loop is not None and self.store.awaits_writers:
            self._poll = self._loop.call_later(_POLL_S, self._poll_published, _POLL_S)
        events = self.names.translate(events)
        if not events or self._listener is None:
            return
        for event in events:
            try:
                self._listener(event)
            except Exception:
                self.num_listener_errors += 1
                log.exception("shm_event_listener_failed", seq=event.seq)

    def _names_came(self) -> None:
        """Names came for parked blocks (``BlockNames.learn``): their events go out soon."""
        if self._drain_soon or self._loop is None:
            return
        self._drain_soon = True

        def drain() -> None:
            self._drain_soon = False
            self.drain_events()

        self._loop.call_soon(drain)

    def _poll_published(self, delay: float) -> None:
        """Record the commits writers made by publishing (``BlockStore.commit_published``)
        and send their events, though no request came; again while reservations stay open,
        backing off while nothing is published (a slow writer, e.g. a device copy)."""
        self._poll = None
        store, cells = self.store, self._cells
        if store is None or cells is None or self._loop is None:
            return
        now = time.monotonic_ns()
        if cells.record_publications() or store.grants_taken:
            self._busy_ns = now
        quiet = now - self._busy_ns > _STANDBY_GRACE_NS or not store.standby_offered
        delay = _POLL_S if now == self._busy_ns or not quiet else min(2 * delay, _POLL_MAX_S)
        if store.awaits_writers:  # armed before draining, which then leaves it as it is
            self._poll = self._loop.call_later(delay, self._poll_published, delay)
        self.drain_events()

    def session_opened(self, conn: Connection) -> SessionId:
        if self.store is None or self._cells is None:
            raise RuntimeError("the owner is not started")
        self._connections.add(conn)
        session = self.store.open_session()
        self._cells.open(session)
        return session

    def session_closed(self, conn: Connection, session: SessionId) -> None:
        self._connections.discard(conn)
        if self._cells is not None:
            self._cells.close(session)
        if self.store is not None:
            self.store.close_session(session)
            self.drain_events()


def _keys(namespaces: list[int], hashes: list[int]) -> list[tuple[int, int]]:
    if len(namespaces) != len(hashes):
        raise ProtocolError(f"{len(namespaces)} namespaces for {len(hashes)} hashes")
    return list(zip(namespaces, hashes, strict=True))
