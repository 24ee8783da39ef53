"""The remote tier: blocks in a Redis-protocol store (Redis, Valkey) shared by every replica of
a model, so a prefix computed on one replica is loaded on any other.

Writes (``shm.tiers.remote_writes``): every block the host store commits (``write="through"``,
the default) or only those it evicts (``write="evict"``), each value carrying the block's
canonical name (``shm.block_names``) in its header, which is what lets every other replica
announce the block; a block the store already holds is not sent again.

The index: which blocks the store holds, kept from the store itself, not from our writes
alone: at connect the tier subscribes to the scope's keyspace notifications (``set``,
``del``, ``expired``, ``evicted``; it turns them on with ``CONFIG SET`` when they are off),
then ``SCAN``s the scope, reading each block's name from its value's header; from then on
each notification updates it. So blocks other replicas write, and blocks the store evicts
under ``maxmemory``, reach every replica's index, which the sidecar announces as ``remote``
events on its own workers' streams: the router credits them on every worker.

Reads (a get that missed in shared memory and on disk: ``read_many``) ``MGET`` the values
and check each one (its header names the key and the size, an xxh3-64 covers the payload)
before it is promoted into a slot. A value that fails its check is deleted from the store.

The store going away is a miss, never a failed request: a read or write that fails is
counted and logged; the watcher reconnects with backoff and, while the store is away,
the tier holds nothing (``AllBlocksCleared`` for ``remote``), then announces what it finds
once back. Call everything from the owner's event loop.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from kvcore.events import KVEvent, Tier
from kvcore.extras import MissingExtraError
from shm.block_names import BlockName
from shm.host_events import HostEventLog
from shm.tiers.disk_format import HEADER_BYTES
from shm.tiers.remote_keys import BATCH_BYTES, KEYSPACE_EVENTS, RemoteKeys, check_value, value_name
from shm.tiers.remote_writes import RemoteWrites

__all__ = ["WRITE_POLICIES", "RemoteTier", "RemoteTierStats", "load_redis"]

log = structlog.get_logger(component="shm")

BlockKey = tuple[int, int]
WRITE_POLICIES = ("through", "evict")
_RETRY_S = (0.1, 5.0)  # the watcher's reconnect backoff, first and longest
_WATCH_POLL_S = 1.0  # the watcher looks at whether the tier is closing this often
_REMOVED = (b"del", b"expired", b"evicted")


def load_redis() -> Any:
    """``redis.asyncio``, or a ``MissingExtraError`` naming the extra to install."""
    try:
        return importlib.import_module("redis.asyncio")
    except ImportError as exc:
        raise MissingExtraError("the remote tier", "remote-tier", "redis", exc) from exc


@dataclass(frozen=True, slots=True)
class RemoteTierStats:
    connected: bool
    num_blocks: int  # blocks the store holds in this scope, as far as the index knows
    num_writes: int
    num_write_bytes: int
    num_reads: int  # blocks read back (promoted into shared memory)
    num_read_bytes: int
    num_misses: int  # the index listed it, the store no longer had it
    num_corrupt: int  # values that failed their check (deleted)
    num_errors: int  # failed store calls (each a miss or a block not written, and a log line)
    num_dropped: int  # blocks not written: the queue was full or the store away
    num_pending: int  # blocks queued for writing
    num_unnamed: int  # blocks write-through holds back until they are named


class RemoteTier:
    """One scope of a shared store; ``await start()`` before use, ``aclose()`` after."""

    def __init__(self, url: str, model_id: str, block_bytes: int, *, worker_id: str,
                 write: str = "through", max_pending_bytes: int = 256 << 20,
                 timeout_s: float = 5.0) -> None:
        if write not in WRITE_POLICIES:
            raise ValueError(f"remote tier write policy must be one of {WRITE_POLICIES}, "
                             f"got {write!r}")
        self._redis = load_redis()
        self.url = url
        self.block_bytes = block_bytes
        self.value_bytes = HEADER_BYTES + block_bytes
        self.write = write
        self.timeout_s = timeout_s
        db = int(self._redis.connection.parse_url(url).get("db", 0))  # ValueError: a bad URL
        self.keys = RemoteKeys(model_id, block_bytes, db)
        self._index: dict[BlockKey, BlockName | None] = {}  # held by the store → name
        self._client: Any = None  # for reads and writes; None while the store is away
        self._writes = RemoteWrites(
            self.keys, self.value_bytes, write=write, max_pending_bytes=max_pending_bytes,
            holds=self.contains, client=lambda: self._client, written=self._written)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False  # aclose began: the watcher connects no more
        self._notify: Callable[[], None] = lambda: None
        self._log = HostEventLog(worker_id, Tier.REMOTE)
        self.num_reads = self.num_read_bytes = self.num_misses = self.num_corrupt = 0
        self.num_errors = 0  # the watcher's, reads' and deletes' (the writes count theirs)

    # ---------------------------------------------------------------- lifecycle
    async def start(self, notify: Callable[[], None], rows: Any,
                    slots_of: Callable[[list[BlockKey]], list[int | None]]) -> None:
        """Start the watcher and the writer; returns at once (the store may be away).
        ``notify``: called when events wait (``take_events``); ``rows``: the segment's
        block rows; ``slots_of``: where the host store holds keys (write-through reads)."""
        self._notify = notify
        self._writes.attach(rows, slots_of)
        self._tasks = [asyncio.create_task(self._watch(), name="remote-tier-watch"),
                       asyncio.create_task(self._writes.run(), name="remote-tier-write")]
        log.info("remote_tier_started", url=_redacted(self.url), scope=self.keys.prefix.decode(),
                 write=self.write)

    async def aclose(self) -> None:
        """Send what is queued (within the timeout), stop, disconnect.

        The tasks get the timeout to end once cancelled, then are left: a shutdown must not
        hang on the store's client. (A sidecar stopped while its watcher was still connecting
        once went on to connect and follow the store after the cancel, until SIGKILL left its
        shared-memory segment behind.)"""
        self._closing = True
        if self._client is not None and self._writes.num_queued:
            try:
                await asyncio.wait_for(self._writes.flush(), self.timeout_s)
            except (TimeoutError, Exception):  # a miss for later, not a failed shutdown
                log.warning("remote_tier_unflushed", blocks=self._writes.num_queued)
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # (the watcher sees _closing within _WATCH_POLL_S)
            _, stuck = await asyncio.wait(self._tasks, timeout=self.timeout_s)
            if stuck:
                log.warning("remote_tier_tasks_stuck", tasks=sorted(t.get_name() for t in stuck))
        self._tasks = []
        self._writes.detach()
        await self._disconnect()

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def connected(self) -> bool:
        return self._client is not None

    # ------------------------------------------------------------------ watcher
    async def _watch(self) -> None:
        """Follow the store; reconnect with backoff while it is away."""
        delay = _RETRY_S[0]
        while not self._closing:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store went away, or refused us
                if self._client is not None or delay == _RETRY_S[0]:
                    log.warning("remote_tier_unreachable", url=_redacted(self.url),
                                error=f"{type(exc).__name__}: {exc}")
                self.num_errors += 1
            if self._went_away():
                delay = _RETRY_S[0]
            await self._disconnect()
            await asyncio.sleep(delay)  # a backoff between attempts, not a wait for an event
            delay = min(2 * delay, _RETRY_S[1])

    def _went_away(self) -> bool:
        """Forget what the store held (announced): True if the tier was connected."""
        was = self._client is not None
        if self._index:
            self._index.clear()
            self._log.cleared()
            self._notify()
        return was

    async def _follow(self) -> None:
        redis = self._redis
        client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                      socket_connect_timeout=self.timeout_s)
        watcher = redis.Redis.from_url(self.url, socket_connect_timeout=self.timeout_s)
        pubsub = watcher.pubsub()
        try:
            await self._turn_on_notifications(client)
            await pubsub.psubscribe(self.keys.channel_pattern)
            held = await self._scan(client)
            if self._closing:
                return
            self._client = client
            self._index = held
            if held:
                self._announce(list(held))
                self._notify()
            log.info("remote_tier_connected", url=_redacted(self.url), blocks=len(held))
            while not self._closing:
                # a bounded wait, so that a closing tier stops here even if its cancel is lost
                msg = await pubsub.get_message(ignore_subscribe_messages=True,
                                               timeout=_WATCH_POLL_S)
                if msg is None:
                    continue
                batch = [msg]
                while (more := await pubsub.get_message(ignore_subscribe_messages=True)):
                    batch.append(more)
                await self._apply(client, [m for m in batch if m is not None])
        finally:
            await pubsub.aclose()
            await watcher.aclose()
            if self._client is not client:
                await client.aclose()

    async def _turn_on_notifications(self, client: Any) -> None:
        have = (await client.config_get("notify-keyspace-events")).get(
            b"notify-keyspace-events", b"").decode()
        if "A" in have:  # "A" stands for "g$lshzxet"
            have = have.replace("A", "g$lshzxet")
        missing = "".join(c for c in KEYSPACE_EVENTS if c not in have)
        if missing:
            await client.config_set("notify-keyspace-events", have + missing)
            log.info("remote_tier_notifications_on", flags=have + missing)

    async def _scan(self, client: Any) -> dict[BlockKey, BlockName | None]:
        """What the store holds in our scope, with each block's name."""
        held: dict[BlockKey, BlockName | None] = {}
        names: list[bytes] = []
        async for name in client.scan_iter(match=self.keys.match, count=1000):
            names.append(name)
            if len(names) == 1000:
                held.update(await self._names(client, names))
                names = []
        held.update(await self._names(client, names))
        return held

    async def _names(self, client: Any,
                     names: Sequence[bytes]) -> dict[BlockKey, BlockName | None]:
        """The blocks under these key names, each with the name its value's header holds."""
        keyed = [(key, name) for name in names if (key := self.keys.key_of(name)) is not None]
        if not keyed:
            return {}
        pipe = client.pipeline(transaction=False)
        for _, name in keyed:
            pipe.getrange(name, 0, HEADER_BYTES - 1)
        heads = await pipe.execute()
        out: dict[BlockKey, BlockName | None] = {}
        for (key, _), head in zip(keyed, heads, strict=True):
            ok, block_name = value_name(head, key, self.block_bytes)
            if ok:  # else: gone meanwhile, or written by another layout or format
                out[key] = block_name
        return out

    async def _apply(self, client: Any, batch: list[dict[str, Any]]) -> None:
        """Keyspace notifications, in order: a ``set`` of a block not held reads its
        name; a removal of a held one drops it."""
        named = [(self.keys.key_of_channel(m["channel"]), m["data"]) for m in batch]
        new = {key for key, what in named if what == b"set" and key is not None
               and key not in self._index}
        names = await self._names(client, [self.keys.name(k) for k in new]) if new else {}
        index = self._index
        stored: list[BlockKey] = []
        for key, what in named:
            if key is None:
                continue
            if what == b"set" and key in names and key not in index:
                index[key] = names[key]
                stored.append(key)
            elif what in _REMOVED and key in index:
                self._announce(stored)
                stored = []
                self._announce_removed([index.pop(key)])
        self._announce(stored)
        self._notify()

    def _announce(self, keys: list[BlockKey]) -> None:
        """``BlockStored`` for the named ones (an unnamed block is held, not announced)."""
        named = [n for k in keys if (n := self._index[k]) is not None]
        self._log.stored([n.block_hash for n in named], [n.parent_hash for n in named],
                         [None] * len(named))

    def _announce_removed(self, names: list[BlockName | None]) -> None:
        self._log.removed([n.block_hash for n in names if n is not None])

    # ------------------------------------------------------------------- writes
    def committed(self, blocks: Sequence[tuple[BlockKey, int]],
                  names: Sequence[BlockName | None]) -> None:
        """The host store's commit hook (write-through): ``RemoteWrites.committed``."""
        self._writes.committed(blocks, names)

    def named(self, came: dict[int, BlockName]) -> None:
        """Names came for blocks held back unnamed: ``RemoteWrites.named``."""
        self._writes.named(came)

    def spill(self, blocks: Sequence[tuple[BlockKey, int]], names: Sequence[BlockName | None],
              rows: np.ndarray) -> None:
        """The host store's eviction hook: ``RemoteWrites.spill``."""
        self._writes.spill(blocks, names, rows)

    def _written(self, blocks: list[tuple[BlockKey, BlockName | None]]) -> None:
        """The store took these blocks: they join the index, the new ones announced."""
        fresh = [(key, name) for key, name in blocks if key not in self._index]
        for key, name in fresh:
            self._index[key] = name
        if fresh:
            self._announce([key for key, _ in fresh])
            self._notify()

    # -------------------------------------------------------------------- reads
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def name_of(self, key: BlockKey) -> BlockName | None:
        """The name a block's value carries (None: unnamed, or not held)."""
        return self._index.get(key)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """The store keeps its own LRU (a read is a use there)."""

    def read_into(self, key: BlockKey, dst: np.ndarray) -> bool:
        """A read that cannot wait for the network: always a miss (see ``read_many``)."""
        return False

    async def read_many(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> list[bool]:
        """Fetch, check and copy each ``(key, dst)``; False for a miss (not held, gone,
        corrupt, or the store away)."""
        out = [False] * len(items)
        per_batch = max(1, BATCH_BYTES // self.value_bytes)
        for start in range(0, len(items), per_batch):
            chunk = items[start : start + per_batch]
            client = self._client
            if client is None:
                return out
            try:
                values = await client.mget([self.keys.name(key) for key, _ in chunk])
            except Exception as exc:
                self.num_errors += 1
                log.warning("remote_tier_read_failed", blocks=len(chunk),
                            error=f"{type(exc).__name__}: {exc}")
                return out
            problems = await asyncio.to_thread(self._unpack, chunk, values)
            for i, ((key, _), value, problem) in enumerate(
                    zip(chunk, values, problems, strict=True)):
                out[start + i] = self._finish_read(key, value, problem)
        return out

    def _unpack(self, chunk: Sequence[tuple[BlockKey, np.ndarray]],
                values: list[bytes | None]) -> list[str | None]:
        """Check each value and copy its payload into its slot (a worker thread)."""
        return [None if value is None else check_value(value, key, self.block_bytes, dst)
                for (key, dst), value in zip(chunk, values, strict=True)]

    def _finish_read(self, key: BlockKey, value: bytes | None, problem: str | None) -> bool:
        if value is None:  # the notification of its removal is on its way
            self.num_misses += 1
            return False
        if problem is not None:
            self.num_corrupt += 1
            log.warning("remote_tier_block_corrupt", key=key, problem=problem)
            self.remove([key])
            return False
        self.num_reads += 1
        self.num_read_bytes += self.value_bytes
        return True

    # ------------------------------------------------------------ removal, events
    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Delete the keys from the store (in the background); per key, whether it held it."""
        for key in keys:
            self._writes.forget_unnamed(key)
        out = [key in self._index for key in keys]
        gone = [key for key, held in zip(keys, out, strict=True) if held]
        if gone and self._client is not None:
            self._announce_removed([self._index.pop(key) for key in gone])
            task = asyncio.get_running_loop().create_task(self._delete(self._client, gone))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)
        return out

    async def _delete(self, client: Any, keys: list[BlockKey]) -> None:
        try:
            await client.delete(*[self.keys.name(key) for key in keys])
        except Exception as exc:
            self.num_errors += 1
            log.warning("remote_tier_delete_failed", blocks=len(keys), error=str(exc))

    def take_events(self) -> list[KVEvent]:
        return self._log.take()

    def stats(self) -> RemoteTierStats:
        writes = self._writes
        return RemoteTierStats(
            connected=self._client is not None,
            num_blocks=len(self._index),
            num_writes=writes.num_writes,
            num_write_bytes=writes.num_write_bytes,
            num_reads=self.num_reads,
            num_read_bytes=self.num_read_bytes,
            num_misses=self.num_misses,
            num_corrupt=self.num_corrupt,
            num_errors=self.num_errors + writes.num_errors,
            num_dropped=writes.num_dropped,
            num_pending=writes.num_pending,
            num_unnamed=writes.num_unnamed,
        )


def _redacted(url: str) -> str:
    """The URL without a password (``redis://:secret@host`` → ``redis://:***@host``)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
