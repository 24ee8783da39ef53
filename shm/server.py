"""The block store owner: segment, store core and control server in one asyncio object.

``async with BlockStoreOwner(config, listener=...) as owner:`` unlinks stale segments of a
dead owner with the same id, creates and pre-faults the segment, and serves clients on the
Unix socket until the block exits, when it drops every client and unlinks the segment and
the socket. The sidecar embeds it in its own loop; ``python -m shm`` is a thin shell.

Each connection is one store session. Frames are handled synchronously (the store core is
pure and fast), in this order: a connection's one-way frames (``Release``, ``Publish``) as
soon as they are read, and a request that needs a reply once every connection that was
readable in the same wake-up has been read (one ``call_soon`` hop, skipped when only one
client is connected). So whatever one-way frame reached the owner before a request was
sent, on any connection, is applied before that request, and so is every commit a writer
made by publishing its slots in the read index (see ``shm.read_index``; while reservations
are open the owner also polls for those, every millisecond or so, for their events): a
block whose ``put_many`` has returned is visible to every later request, and a lease given
back is evictable.
When a connection closes, however the client died, the frames it had sent are applied,
then its reservations are freed and its leases released. After each request the store's
events go to ``listener``, a plain callable that must not block (the sidecar's puts them
on a bounded queue); an exception from it is logged and counted, never lost silently and
never fatal to the store.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import assert_never, cast

import msgspec
import structlog

from kvcore.events import KVEvent
from shm.config import OwnerConfig
from shm.errors import BlockStoreError, ClientDetachedError, OwnerConflictError, ProtocolError
from shm.protocol import (
    ONE_WAY_TAGS,
    PROTOCOL_VERSION,
    Abort,
    Claim,
    Contains,
    Done,
    ErrorReply,
    Flags,
    FrameReader,
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
)
from shm.read_index import MAX_HIT_CELLS
from shm.segment import Segment, unlink_stale_segments
from shm.store import BlockStore, SessionId, StoreStats

__all__ = ["BlockStoreOwner", "EventListener"]

log = structlog.get_logger(component="shm")

EventListener = Callable[[KVEvent], None]
_DONE = encode(Done())
# While reservations are open, the owner polls for writers' commits every _POLL_S, backing
# off to _POLL_MAX_S while none come (an event loop's timers tick in milliseconds).
_POLL_S = 0.001
_POLL_MAX_S = 0.064


class BlockStoreOwner:
    """Owns one segment and serves it; an async context manager."""

    def __init__(self, config: OwnerConfig, listener: EventListener | None = None) -> None:
        self.config = config
        self._listener = listener
        self.epoch = time.time_ns() // 1000
        self.segment: Segment | None = None
        self.store: BlockStore | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._welcome: Welcome | None = None
        # Optimistic readers count their hits in cells of the segment's read index.
        # Oldest-freed first: a client the owner dropped may still count hits in its old cell
        # until it notices, so a freed cell goes to the back of the line.
        self._free_cells = collections.deque(range(MAX_HIT_CELLS))
        self._cell_of: dict[SessionId, int] = {}
        self._publications_seen: dict[SessionId, int] = {}  # per session, its cell's count
        self._retired_hits = 0  # counted in the cells of clients now gone
        self._bound = False
        self.num_listener_errors = 0
        self.num_rejected_releases = 0
        self.num_rejected_commits = 0  # one-way ``Publish`` frames that failed
        self._waiting: list[_Connection] = []  # with a request queued for ``_run_waiting``
        self._poll: asyncio.TimerHandle | None = None  # see ``_poll_published``
        self._loop: asyncio.AbstractEventLoop | None = None  # the one we serve in
        self.num_internal_errors = 0

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
                lambda: _Connection(self), path=str(cfg.socket_path)
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
            self.store = None
            self._release_segment()
            raise
        log.info("shm_owner_started", owner_id=cfg.owner_id, socket=str(cfg.socket_path),
                 segment=self.segment.name, num_slots=cfg.num_slots,
                 block_bytes=cfg.block_bytes, epoch=self.epoch)

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
        if self.store is not None:
            self.store.clear()
            self.drain_events()
            self.store = None  # it holds a view of the segment's generation table
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
        if self.store is None or self.segment is None:
            raise RuntimeError("the owner is not started")
        self._record_publications()
        stats = self.store.stats()
        cells = self.segment.index.hit_cells
        optimistic = self._retired_hits + sum(int(cells[c]) for c in self._cell_of.values())
        return replace(stats, num_hits=stats.num_hits + optimistic,
                       num_optimistic_hits=optimistic)

    def handle(self, session: SessionId, body: bytes, *, drain: bool = True) -> bytes | None:
        """One request frame body → one reply frame (``None`` for one-way frames).

        ``drain=False`` leaves the store's events, and the books a reservation's reply does
        not need, for ``drain_events``: a connection sends the reply first, so neither the
        listener's work nor the bookkeeping is on the client's round trip.
        """
        if self.store is None:
            return encode(ErrorReply("client_detached", "the owner is shutting down"))
        try:
            msg = decode_request(body)
        except ProtocolError as exc:
            if _is_one_way(body):  # the client waits for no reply: log, don't answer
                self._reject_one_way(session, body[1], exc)
                return None
            return encode(ErrorReply(exc.code, str(exc)))
        if not isinstance(msg, Release | Publish):
            # What writers committed by publishing is visible to every request that follows.
            self._record_publications()
        try:
            reply = self._dispatch(self.store, session, msg)
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

    def _dispatch(self, store: BlockStore, session: SessionId, msg: Request) -> bytes | None:
        match msg:
            case Reserve(namespaces, hashes, parents, tokens, grant):
                keys = _keys(namespaces, hashes)
                slots, gens = store.reserve(session, keys, parents, tokens)
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
            case Lease(namespaces, hashes):
                return encode(Slots(*store.lease(session, _keys(namespaces, hashes))))
            case Release(slots, generations):
                store.release(session, slots, generations)
                return None
            case Abort(slots, generations):
                store.abort(session, slots, generations)
                return _DONE
            case Contains(namespaces, hashes):
                return encode(Flags(store.contains(_keys(namespaces, hashes))))
            case Remove(namespaces, hashes):
                return encode(Flags(store.remove(_keys(namespaces, hashes))))
            case Stats():
                return encode(StatsReply(self.stats()))
            case Ping():
                return _DONE
            case Hello(version, _pid):
                if version != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"client speaks protocol {version}, owner {PROTOCOL_VERSION}")
                assert self._welcome is not None  # set before the server accepts anyone
                return encode(msgspec.structs.replace(
                    self._welcome, hit_cell=self._cell_of.get(session, -1)))
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
        """Commit reserved slots of an in-process session (``shm.local``), which needs the
        store's verdict (a stale descriptor raises here) and sends no frame; clients
        commit by publishing their slots in the read index, or with ``Publish``."""
        if self.store is None:
            raise ClientDetachedError("the owner is shutting down")
        self.store.commit(session, slots, generations)
        self.drain_events()

    def wait_turn(self, conn: _Connection) -> bool:
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
        if self._poll is None and self._loop is not None and self.store.num_reserved:
            self._poll = self._loop.call_later(_POLL_S, self._poll_published, _POLL_S)
        if not events or self._listener is None:
            return
        for event in events:
            try:
                self._listener(event)
            except Exception:
                self.num_listener_errors += 1
                log.exception("shm_event_listener_failed", seq=event.seq)

    def _record_publications(self) -> int:
        """Commit what writers have published since we last looked: the reservations of
        the clients whose publication count moved (``shm.read_index``), a few integer
        compares when none did. How many blocks."""
        if self.store is None or self.segment is None:
            return 0
        index, seen = self.segment.index, self._publications_seen
        moved = []
        for session, cell in self._cell_of.items():
            count = index.publications(cell)  # read before the slots: a later one moves it
            if count != seen.get(session, 0):
                seen[session] = count
                moved.append(session)
        return self.store.commit_published(moved) if moved else 0

    def _poll_published(self, delay: float) -> None:
        """Record the commits writers made by publishing (``BlockStore.commit_published``)
        and send their events, though no request came; again while reservations stay open,
        backing off while nothing is published (a slow writer, e.g. a device copy)."""
        self._poll = None
        store = self.store
        if store is None or self._loop is None:
            return
        delay = _POLL_S if self._record_publications() else min(2 * delay, _POLL_MAX_S)
        if store.num_reserved:  # armed before draining, which then leaves it as it is
            self._poll = self._loop.call_later(delay, self._poll_published, delay)
        self.drain_events()

    def session_opened(self, conn: _Connection) -> SessionId:
        if self.store is None:
            raise RuntimeError("the owner is not started")
        self._connections.add(conn)
        session = self.store.open_session()
        if self._free_cells:  # else the client leases every read (1,024 clients attached)
            self._cell_of[session] = self._free_cells.popleft()
        return session

    def session_closed(self, conn: _Connection, session: SessionId) -> None:
        self._connections.discard(conn)
        cell = self._cell_of.pop(session, None)
        self._publications_seen.pop(session, None)
        if cell is not None and self.segment is not None:
            index = self.segment.index
            self._retired_hits += int(index.hit_cells[cell])
            index.hit_cells[cell] = 0
            index.count_publication(cell, 0)
            self._free_cells.append(cell)
        if self.store is not None:
            self.store.close_session(session)
            self.drain_events()


def _is_one_way(body: bytes) -> bool:
    """Whether a body is tagged ``Release`` or ``Publish``: a msgpack array, then its tag."""
    return len(body) > 1 and 0x90 <= body[0] <= 0x9F and body[1] in ONE_WAY_TAGS


def _keys(namespaces: list[int], hashes: list[int]) -> list[tuple[int, int]]:
    if len(namespaces) != len(hashes):
        raise ProtocolError(f"{len(namespaces)} namespaces for {len(hashes)} hashes")
    return list(zip(namespaces, hashes, strict=True))


class _Connection(asyncio.Protocol):
    """One client connection = one store session."""

    def __init__(self, owner: BlockStoreOwner) -> None:
        self._owner = owner
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._session: SessionId | None = None
        self._queued: list[bytes] = []  # a request and what followed it, awaiting our turn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._session = self._owner.session_opened(self)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None and self._session is not None
        try:
            bodies = self._reader.feed(data)
        except ProtocolError as exc:
            log.warning("shm_client_dropped", session=self._session, error=str(exc))
            self._transport.write(encode(ErrorReply(exc.code, str(exc))))
            self._transport.close()
            return
        if self._queued:  # still waiting for our turn: keep the order
            self._queued += bodies
            return
        handle, session = self._owner.handle, self._session
        for i, body in enumerate(bodies):
            if not _is_one_way(body):
                self._queued = bodies[i:]
                if not self._owner.wait_turn(self):
                    self.run_queued()
                return
            handle(session, body)  # one-way: nobody waits, drain at once

    def run_queued(self) -> None:
        """Handle the queued frames in order, sending each reply as soon as it is made."""
        bodies, self._queued = self._queued, []
        if self._session is None or not bodies:
            return
        owner, session = self._owner, self._session
        for body in bodies:  # reply first: the listener's work is not on the round trip
            reply = owner.handle(session, body, drain=False)
            if reply and self._transport is not None and not self._transport.is_closing():
                self._transport.write(reply)
            owner.drain_events()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._session is not None:
            self.run_queued()  # e.g. a Publish sent just before the client exited
            self._owner.session_closed(self, self._session)
            self._session = None

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

