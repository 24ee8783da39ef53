"""The canonical names of the store's blocks, and the host tier's events in their terms.

A block is *named* by its canonical hash and its canonical parent (``kvcore.hashing``): what
the gateway's prefix index, and every event leaving the sidecar, calls it. The store keys a
block by whatever the engine's storage hook puts it under, which is one of two things:

* **canonical keys** (``canonical_keys=True``: TensorRT-LLM's connector, ``python -m shm``
  and its clients): a block's name is its key's hash, with the parent its put named. The
  store's events are already canonical and pass as they are.
* **the engine's own keys** (SGLang's HiCache backend: the page hash, the first 8 bytes of
  the page's SHA-256). The hook knows no tokens, so it cannot name the block; the engine's
  adapter can, from the engine's KV events, where the same page hash comes with the page's
  tokens: it re-hashes them canonically (``adapters.normalize``, the one home of the mapping
  from an engine's block identity to canonical hashes) and reports each chain it stores as
  (store hashes, canonical hashes, canonical parent): ``learn``. The lower tiers keep a
  block's name with it (in their files' and values' headers: ``shm.tiers.disk_format``), so a
  block another replica wrote to the remote tier, or one the disk tier kept across a
  restart, is named without any event of this engine; a block they promote into shared
  memory brings its name along (``learn_one``).

The hook may put a page before the engine's event about it arrives (the reference engine
writes through before it publishes), or long after. So a host block committed before its
name is known is *parked*: held and readable, not announced; the name's arrival announces it
(``BlockStored``, tier ``host``), its removal first drops it silently. The published state is
therefore always a subset of what the store holds, as the adapters' normalizers keep theirs.
A page whose store key is not its event hash (SGLang's salted requests, whose storage keys
chain from another seed) never gets a name and is never announced.

Names learned for blocks the store does not hold yet are kept in an LRU of ``capacity``
entries (a page the engine stored is put soon after, or before); names of held blocks are
kept while they are held. Pure and synchronous: the owner calls it on its loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
)
from shm.host_events import HostEventLog

__all__ = ["BlockName", "BlockNames", "NamedListener"]

DEFAULT_CAPACITY = 1 << 16


@dataclass(frozen=True, slots=True)
class BlockName:
    """A block's canonical hash, and its canonical parent's (None: the chain's first)."""

    block_hash: int
    parent_hash: int | None


# Called with the names that came for parked blocks (store hash → name).
NamedListener = Callable[[dict[int, BlockName]], None]


class BlockNames:
    """Names of one store's blocks (see the module docstring)."""

    def __init__(self, worker_id: str, *, canonical_keys: bool = True,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.worker_id = worker_id
        self.canonical_keys = canonical_keys
        self.capacity = capacity
        self._known: OrderedDict[int, BlockName] = OrderedDict()  # learned, by last use
        self._held: dict[int, BlockName] = {}  # announced host blocks
        self._parked: dict[int, None] = {}  # host blocks waiting for their names, in order
        self._log = HostEventLog(worker_id)  # host events, canonical, not taken yet
        self.listeners: list[NamedListener] = []
        self.notify: Callable[[], None] = lambda: None  # events wait in ``take``
        self.num_learned = 0  # names reported by the engine's adapter (blocks)
        self.num_late = 0  # parked blocks announced once their names came

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    # ---------------------------------------------------------------- learning
    def learn(self, store_hashes: Sequence[int], block_hashes: Sequence[int],
              parent_hash: int | None) -> None:
        """A chain the engine stored: each block's store hash and canonical hash, the
        canonical parent of the first (the adapter's report; a no-op for canonical keys)."""
        if self.canonical_keys:
            return
        known, parked = self._known, self._parked
        came: dict[int, BlockName] = {}
        for store_hash, block_hash in zip(store_hashes, block_hashes, strict=False):
            name = BlockName(block_hash, parent_hash)
            parent_hash = block_hash
            known[store_hash] = name
            known.move_to_end(store_hash)
            if store_hash in parked:
                came[store_hash] = name
        self.num_learned += len(block_hashes)
        self._trim()
        if came:
            self._announce(came)

    def learn_one(self, store_hash: int, name: BlockName) -> None:
        """The name a lower tier kept with a block (promoted into shared memory)."""
        if self.canonical_keys:
            return
        self._known[store_hash] = name
        self._known.move_to_end(store_hash)
        self._trim()
        if store_hash in self._parked:
            self._announce({store_hash: name})

    def _trim(self) -> None:
        known = self._known
        while len(known) > self.capacity:
            known.popitem(last=False)

    def _announce(self, came: dict[int, BlockName]) -> None:
        for store_hash, name in came.items():
            del self._parked[store_hash]
            self._held[store_hash] = name
        self.num_late += len(came)
        self._announce_stored(list(came.values()))
        for listener in self.listeners:
            listener(came)
        self.notify()

    # ----------------------------------------------------------------- lookups
    def name_of(self, store_hash: int, store_parent: int | None = None) -> BlockName | None:
        """The block's name, or None while it is not known."""
        if self.canonical_keys:
            return BlockName(store_hash, store_parent)
        return self._held.get(store_hash) or self._known.get(store_hash)

    def names_of(self, store_hashes: Sequence[int],
                 store_parents: Sequence[int | None]) -> list[BlockName | None]:
        if self.canonical_keys:
            return [BlockName(h, p) for h, p in zip(store_hashes, store_parents, strict=True)]
        held, known = self._held, self._known
        return [held.get(h) or known.get(h) for h in store_hashes]

    def store_hashes_named(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """The store hash of each of ``block_hashes`` (canonical) that names a held block,
        by canonical hash (a peer pulling a prefix it knows by its canonical hashes)."""
        if self.canonical_keys:
            return {h: h for h in block_hashes}
        wanted = set(block_hashes)
        return {name.block_hash: store_hash for store_hash, name in self._held.items()
                if name.block_hash in wanted}

    # ------------------------------------------------------------ translation
    def translate(self, events: list[KVEvent]) -> list[KVEvent]:
        """The store's events in canonical terms: host events by their blocks' names
        (parked, or dropped, where not named); the lower tiers' are canonical already.
        Events announced since the last call (names that came late) go first."""
        if self.canonical_keys:
            return events
        out = self._log.take()
        named: list[BlockName] = []  # of consecutive stored events: one chain, one event
        for event in events:
            if isinstance(event, BlockStored) and event.tier is Tier.HOST:
                named += self._stored(event)
                continue
            self._announce_stored(named)
            named = []
            if event.tier is not Tier.HOST:
                out += self._log.take()
                out.append(event)
                continue
            if isinstance(event, BlockRemoved):
                self._removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for store_hash, name in self._held.items():
                    self._known[store_hash] = name
                self._trim()
                self._held.clear()
                self._parked.clear()
                self._log.cleared()
            out += self._log.take()
        self._announce_stored(named)
        return out + self._log.take()

    def take(self) -> list[KVEvent]:
        """Events announced by names that came late, not handed out yet."""
        return self._log.take()

    def _stored(self, event: BlockStored) -> list[BlockName]:
        """The names of the stored blocks known now; the others parked."""
        held, known, parked = self._held, self._known, self._parked
        named: list[BlockName] = []
        for store_hash in event.block_hashes:
            name = held.get(store_hash) or known.get(store_hash)
            if name is None:
                parked[store_hash] = None
            else:
                held[store_hash] = name
                named.append(name)
        return named

    def _announce_stored(self, named: list[BlockName]) -> None:
        if named:
            self._log.stored([n.block_hash for n in named], [n.parent_hash for n in named],
                             [None] * len(named))

    def _removed(self, store_hashes: Sequence[int]) -> None:
        held, known, parked = self._held, self._known, self._parked
        gone: list[int] = []
        for store_hash in store_hashes:
            name = held.pop(store_hash, None)
            if name is None:
                parked.pop(store_hash, None)
                continue
            gone.append(name.block_hash)
            known[store_hash] = name  # it may spill to a lower tier, or come back
            known.move_to_end(store_hash)
        self._trim()
        self._log.removed(gone)
