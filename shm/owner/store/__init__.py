"""The block store core: keys → slots, reservations, leases, LRU eviction, host-tier events.

Pure and synchronous: no sockets, no asyncio, no shared memory of its own (the owner hands
it the segment's generation table to mirror and its read index to keep in step: see
``shm.read_index``). Callers are *sessions* (one per client connection); whatever a session
holds is given back by ``close_session`` when its client goes away.

One concept per module, each a part of ``BlockStore``:

* ``books``: the state every part reads and writes (per slot, per session, counters);
* ``eviction``: the LRU, and which blocks make room when slots are needed;
* ``reservations``: a put's slots, reserved, then committed (by the client's publication
  in the read index, or ``Publish``) or aborted;
* ``standby``: once the store is full, its least recently used blocks offered to a writer
  to overwrite with its next put, which it records in the read index with no message;
  taken back whenever another client needs them;
* ``grants``: free slots granted to a writer ahead of its keys, then claimed for them;
* ``leases``: a get through the owner pins its blocks while it copies;
* ``block_store``: ``BlockStore`` itself, with sessions, removal, events and statistics.

Every commit, eviction and removal is recorded as a normalized host-tier event
(``shm.host_events``), which the owner drains with ``take_events``.
"""

from shm.owner.store.block_store import BlockStore, StoreStats
from shm.owner.store.books import BlockKey, SessionId

__all__ = ["BlockKey", "BlockStore", "SessionId", "StoreStats"]
