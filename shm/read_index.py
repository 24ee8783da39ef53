"""The segment's read index: readers in other processes copy committed blocks without asking
the owner.

A get used to cost a control round trip before its copy (lease, copy, release). Right after
a large copy both processes run on cold caches and a vCPU must be woken, so that round trip
costs several times its warm figure; on a 256 KiB × 64 batch it was a quarter of the copy.
So the owner publishes, in the segment, which key each committed slot holds, and a reader
that knows where a key was (its own put, an earlier lease or read: a *hint*) copies
optimistically, validating with a per-slot sequence number (a seqlock):

* ``seq[slot]`` is even while the slot holds a complete block and odd otherwise. The owner
  writes the slot's key, then makes ``seq`` even (``publish``, on commit); before the slot
  can be removed, evicted or handed to a writer it makes ``seq`` odd (``retract``). The one
  other writer is the client a slot is reserved to: once its bytes are in, it publishes the
  slot itself, and that *is* its commit, with no message: a read right behind its put needs
  no owner, and the put costs no socket write (a write that wakes the owner's CPU costs tens
  of µs in a VM). The owner records such commits (``published``) before it handles any
  request, so a block whose put has returned is visible to every later request from any
  client, and on a poll of about a millisecond while reservations are open, for the events;
  a client dying with published slots has committed them. If a reservation is aborted
  instead, or its client dies before publishing, the owner makes the slot odd before
  freeing it.
* A reader loads ``seq`` (must be even), checks the slot's key, copies, and loads ``seq``
  again: equal means no retract happened in between, so no writer can have been given the
  slot and the bytes are the committed block's. Otherwise, or without a hint, the reader
  leases through the owner, which first records what writers have published (and applies
  any ``Publish`` still in flight): a block whose ``put_many`` has returned is never missed.
* ``read_ns[slot]`` is the time (``CLOCK_MONOTONIC``: one clock for every process) of the
  slot's last optimistic read, written by readers on every hit; the owner weighs it with its
  own record of the block's last use when it picks what to evict, so optimistic reads still
  keep blocks recent.
* ``hit_cells[cell]`` counts one client's optimistic hits (each client writes only the cell
  the owner gave it), for the owner's statistics; ``publish_cells[cell]`` counts its
  publications (each raised after the slots it published), so that before a request the
  owner looks for commits only among the reservations of clients whose count moved.
* ``standby_cells[cell]`` is one client's *standby word*: ``epoch << 3 | state``, saying
  who has the standby grant of that epoch, committed blocks the owner offered the client
  to overwrite with its next put (``shm.owner.store.standby``); ``standby_heads[cell]`` and the
  per-slot ``links`` hold the grant's slot list (first slot, count; next slot). The owner
  writes the list, then stores OFFERED; then the client swaps it to TAKEN before it writes
  a slot of the grant, or the owner swaps it to REVOKED to give the blocks to others. Both
  swap with one compare-and-swap (``shm._atomic``), so exactly one of them wins, with no
  fence to get right. A TAKEN list is the writer's: once its copy is in, it rewrites the
  list as the slots it wrote (their parents in ``parents``, flagged in ``links``),
  publishes them, stores DONE and counts the publication, which is how the owner learns
  of it: a put over a grant sends no message at all.

The index keeps no key → slot map: hints cost the owner nothing and the common reader, an
engine reading back what it offloaded, always has one.

Correctness rests on stores becoming visible in program order and loads not passing loads,
which x86-64 guarantees (TSO); numpy cannot issue the barriers weaker memory models need, so
clients read optimistically only on x86-64 (``OPTIMISTIC_READS_SUPPORTED``) and lease
elsewhere.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shm._atomic import compare_exchange

__all__ = [
    "MAX_HIT_CELLS",
    "OPTIMISTIC_READS_SUPPORTED",
    "STANDBY_DONE",
    "STANDBY_OFFERED",
    "STANDBY_REVOKED",
    "STANDBY_TAKEN",
    "ReadIndex",
    "ReadIndexLayout",
]

MAX_HIT_CELLS = 1024
OPTIMISTIC_READS_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")

# A standby word's states (its low three bits; see the module docstring).
STANDBY_OFFERED, STANDBY_TAKEN, STANDBY_REVOKED, STANDBY_DONE = 1, 2, 3, 4
_HAS_PARENT = 1 << 32
_LOW = (1 << 32) - 1

BlockKey = tuple[int, int]
_ONE = np.uint64(1)


@dataclass(frozen=True, slots=True)
class ReadIndexLayout:
    """Byte offsets of the index's arrays inside its region, from the slot count alone."""

    num_slots: int

    @property
    def seq_offset(self) -> int:
        return 0

    @property
    def keys_offset(self) -> int:
        return 8 * self.num_slots

    @property
    def read_ns_offset(self) -> int:
        return 24 * self.num_slots

    @property
    def cells_offset(self) -> int:
        return 32 * self.num_slots

    @property
    def publish_cells_offset(self) -> int:
        return self.cells_offset + 8 * MAX_HIT_CELLS

    @property
    def standby_cells_offset(self) -> int:
        return self.publish_cells_offset + 8 * MAX_HIT_CELLS

    @property
    def standby_heads_offset(self) -> int:
        return self.standby_cells_offset + 8 * MAX_HIT_CELLS

    @property
    def links_offset(self) -> int:
        return self.standby_heads_offset + 8 * MAX_HIT_CELLS

    @property
    def parents_offset(self) -> int:
        return self.links_offset + 8 * self.num_slots

    @property
    def nbytes(self) -> int:
        return self.parents_offset + 8 * self.num_slots


class ReadIndex:
    """Views of the index region: the owner and, for slots reserved to them, writers publish;
    readers validate and copy."""

    def __init__(self, region: np.ndarray, num_slots: int, *, owner: bool) -> None:
        lay = ReadIndexLayout(num_slots)
        if region.nbytes < lay.nbytes:
            raise ValueError(f"a read index of {num_slots} slots needs {lay.nbytes} bytes, "
                             f"got {region.nbytes}")
        n = num_slots
        self.seq = region[lay.seq_offset : lay.seq_offset + 8 * n].view("<u8")
        # (namespace seed, block hash) per slot
        self.keys = region[lay.keys_offset : lay.keys_offset + 16 * n].view("<u8").reshape(n, 2)
        self.read_ns = region[lay.read_ns_offset : lay.read_ns_offset + 8 * n].view("<u8")
        self.hit_cells = region[lay.cells_offset : lay.publish_cells_offset].view("<u8")
        self.publish_cells = region[lay.publish_cells_offset : lay.standby_cells_offset].view(
            "<u8")
        self.standby_cells = region[lay.standby_cells_offset : lay.standby_heads_offset].view(
            "<u8")
        self.standby_heads = region[lay.standby_heads_offset : lay.links_offset].view("<u8")
        self.links = region[lay.links_offset : lay.parents_offset].view("<u8")
        self.parents = region[lay.parents_offset : lay.nbytes].view("<u8")
        self._standby_words = self.standby_cells.data.cast("B").cast("Q")
        self._heads = self.standby_heads.data.cast("B").cast("Q")
        self._links = self.links.data.cast("B").cast("Q")
        self._parents = self.parents.data.cast("B").cast("Q")
        self._standby_base = self.standby_cells.ctypes.data
        # Per-slot access through a memoryview costs far less than numpy scalar indexing.
        self._read_ns = self.read_ns.data.cast("B").cast("Q")
        self._seq = self.seq.data.cast("B").cast("Q")
        self._key_words = self.keys.reshape(-1).data.cast("B").cast("Q")
        self._publish_counts = self.publish_cells.data.cast("B").cast("Q")
        if owner:
            self.seq[:] = 1  # odd: no slot holds a committed block yet
            self.keys[:] = 0
            self.read_ns[:] = 0
            self.hit_cells[:] = 0
            self.publish_cells[:] = 0
            self.standby_cells[:] = 0
            self.standby_heads[:] = 0

    # ------------------------------------------------------------------ owner side
    def publish(self, slots: Sequence[int | None], keys: Sequence[BlockKey]) -> None:
        """Make complete ``slots`` (distinct; ``None`` entries are skipped) readable as
        ``keys``, as ``publish_slot`` does for one, inline: this runs once per put, on
        caches the put's copy has just flushed."""
        key_words, seq = self._key_words, self._seq
        for slot, (namespace, block_hash) in zip(slots, keys, strict=True):
            if slot is None:
                continue
            word = 2 * slot
            key_words[word] = namespace
            key_words[word + 1] = block_hash
            value = seq[slot]
            if value & 1:
                seq[slot] = value + 1

    def published(self, reserved: Iterable[tuple[BlockKey, int]]) -> list[int]:
        """The slots of ``(key, slot)`` reservations that their writers have published as
        that key (seq even, key words equal), in the order given: committed by their
        writers, for the owner to record (``BlockStore.commit_published``)."""
        seq, key_words = self._seq, self._key_words
        return [slot for (namespace, block_hash), slot in reserved
                if not seq[slot] & 1 and key_words[2 * slot] == namespace
                and key_words[2 * slot + 1] == block_hash]

    def publications(self, cell: int) -> int:
        """How many times the client of ``cell`` has published (``count_publication``)."""
        return self._publish_counts[cell]

    def count_publication(self, cell: int, count: int) -> None:
        """A client's count of its publications, stored after the slots it published (the
        client serializes its calls: one writer per cell)."""
        self._publish_counts[cell] = count

    def publish_slot(self, slot: int, key: BlockKey) -> None:
        """Make complete ``slot`` readable as ``key``: key first, then seq even (if the writer
        already published it, unchanged). The owner calls it on commit, a writer on a slot
        reserved to it once its bytes are written. Memoryviews, not numpy: a batch is tens
        of slots, where numpy's per-call cost (on caches a block copy has just flushed)
        would dominate."""
        key_words, seq = self._key_words, self._seq
        key_words[2 * slot] = key[0]
        key_words[2 * slot + 1] = key[1]
        value = seq[slot]
        if value & 1:
            seq[slot] = value + 1

    def unpublish(self, slots: Sequence[int]) -> None:
        """Make reserved ``slots`` odd again (a writer may have published them) before they
        are freed uncommitted."""
        seq = self._seq
        for slot in slots:
            value = seq[slot]
            if not value & 1:
                seq[slot] = value + 1

    def retract(self, slots: Sequence[int]) -> None:
        """Make committed ``slots`` (distinct) unreadable before they are removed or reused."""
        seq = self._seq
        for slot in slots:
            seq[slot] += 1

    def retract_all(self) -> None:
        self.seq[(self.seq & _ONE) == 0] += _ONE

    def last_read_ns(self, slot: int) -> int:
        """When a reader last read ``slot`` optimistically (0: never)."""
        return self._read_ns[slot]

    # ----------------------------------------------------- standby words (both sides)
    def offer_standby(self, cell: int, epoch: int, slots: Sequence[int]) -> None:
        """(Owner.) Offer ``cell``'s client the standby grant ``slots`` of ``epoch``: the
        list (head word, links) first, then the word, which the client reads first."""
        self._write_list(cell, slots)
        self._standby_words[cell] = epoch << 3 | STANDBY_OFFERED

    def swap_standby(self, cell: int, epoch: int, to: int) -> bool:
        """Swap ``cell``'s standby word from OFFERED to ``to`` (TAKEN: the client;
        REVOKED: the owner) for ``epoch``; whether this side won."""
        return compare_exchange(self._standby_base + 8 * cell,
                                epoch << 3 | STANDBY_OFFERED, epoch << 3 | to)

    def standby_state(self, cell: int, epoch: int) -> int:
        """The state of ``cell``'s grant of ``epoch`` (-1: the word is at another epoch)."""
        word = self._standby_words[cell]
        return word & 7 if word >> 3 == epoch else -1

    def offered(self, cell: int, want: int) -> tuple[int, int]:
        """(Client.) The epoch of ``cell``'s offered grant and its size, if it is offered
        and holds at least ``want`` slots; else ``(0, 0)``. The size may be a later
        offer's: the swap of this epoch then fails."""
        word = self._standby_words[cell]
        if word & 7 != STANDBY_OFFERED:
            return 0, 0
        count = self._heads[cell] >> 32
        return (word >> 3, count) if count >= want else (0, 0)

    def grant_slots(self, cell: int) -> list[int]:
        """``cell``'s grant list (client: once taken, when nobody changes it; owner: the
        writer's record once DONE)."""
        head = self._heads[cell]
        slot, links = head & _LOW, self._links
        out = []
        for _ in range(head >> 32):
            out.append(slot)
            slot = links[slot] & _LOW
        return out

    def record_overwrite(self, cell: int, slots: Sequence[int],
                         parents: Sequence[int | None] | None) -> None:
        """(Writer.) Record the slots it wrote over its taken grant (their keys are in the
        key words) and their parents, for the owner to pick up; call ``done_standby`` once
        the slots are published."""
        if parents is not None:
            words = self._parents
            for slot, parent in zip(slots, parents, strict=True):
                if parent is not None:
                    words[slot] = parent
        self._write_list(cell, slots, parents)

    def done_standby(self, cell: int, epoch: int) -> None:
        """(Writer.) Its record of ``epoch`` is complete (a plain store: TAKEN is ours)."""
        self._standby_words[cell] = epoch << 3 | STANDBY_DONE

    def recorded_parents(self, slots: Sequence[int]) -> list[int | None] | None:
        """(Owner.) The parents recorded with ``slots`` (a DONE record's list)."""
        links, words = self._links, self._parents
        out = [words[slot] if links[slot] & _HAS_PARENT else None for slot in slots]
        return None if all(p is None for p in out) else out

    def keys_of(self, slots: Sequence[int]) -> list[BlockKey]:
        """(Owner.) The keys published in ``slots``' key words."""
        words = self._key_words
        return [(words[2 * slot], words[2 * slot + 1]) for slot in slots]

    def is_retracted(self, slot: int) -> bool:
        return bool(self._seq[slot] & 1)

    def _write_list(self, cell: int, slots: Sequence[int],
                    parents: Sequence[int | None] | None = None) -> None:
        links = self._links
        for i in range(len(slots) - 1):
            links[slots[i]] = slots[i + 1]
        if slots:
            links[slots[-1]] = 0
        if parents is not None:
            for slot, parent in zip(slots, parents, strict=True):
                if parent is not None:
                    links[slot] |= _HAS_PARENT
        self._heads[cell] = (slots[0] if slots else 0) | len(slots) << 32

    # ----------------------------------------------------------------- reader side
    def shows(self, keys: Sequence[BlockKey], hints: Mapping[int, int]) -> list[bool]:
        """Per key, whether its hinted slot holds it now (a writer skips such keys).
        ``hints`` maps a block hash to the slot last seen holding it."""
        if hints.keys().isdisjoint([key[1] for key in keys]):  # a writer's fresh keys
            return [False] * len(keys)
        seq, key_words = self._seq, self._key_words
        out = []
        for key in keys:
            slot = hints.get(key[1])
            out.append(slot is not None and not seq[slot] & 1
                       and key_words[2 * slot] == key[0] and key_words[2 * slot + 1] == key[1])
        return out

    def read(
        self,
        keys: Sequence[BlockKey],
        hints: Mapping[int, int],
        copy: Callable[[int, int], None],
    ) -> list[bool]:
        """Copy every key whose hinted slot holds it: ``copy(i, slot)`` for key ``i``
        (``hints``: block hash → slot; the slot's key words settle the namespace).

        Per key, whether it was copied and still valid after the copy. Per slot: load
        ``seq`` (even), compare the key, copy, and once every copy is done load ``seq`` again
        (unchanged: a hit, and its read time is set). Plain loops over memoryviews: for tens
        of keys on caches a block copy has just flushed, numpy's per-call cost dominates.
        """
        seq, key_words = self._seq, self._key_words
        copied: list[tuple[int, int, int]] = []  # (key index, slot, seq)
        for i, key in enumerate(keys):
            slot = hints.get(key[1])
            if slot is None:
                continue
            before = seq[slot]
            if before & 1 or key_words[2 * slot] != key[0] or key_words[2 * slot + 1] != key[1]:
                continue
            copy(i, slot)
            copied.append((i, slot, before))
        hits = [False] * len(keys)
        now, read_ns = time.monotonic_ns(), self._read_ns
        for i, slot, before in copied:
            if seq[slot] == before:
                hits[i] = True
                read_ns[slot] = now
        return hits
