"""A client's mapping of the owner's segment: what both clients share about blocks.

The clients differ only in how a frame crosses the socket (``shm.client._transport``); everything
about blocks (shape checks, copies into and out of slot views, generation checks, reads
through the read index and their hints, the commit of a filled reservation, standby
grants taken and recorded) lives here once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shm._atomic import AVAILABLE as ATOMIC_AVAILABLE
from shm.client._blocks import BlockFormat
from shm.client._cuda import CudaMapping
from shm.client._requests import descriptors
from shm.errors import (
    ClientDetachedError,
    ForeignSegmentError,
    HeaderCorruptError,
    StaleDescriptorError,
)
from shm.owner.store import BlockKey
from shm.protocol import Publish, Slots, Welcome
from shm.read_index import OPTIMISTIC_READS_SUPPORTED, STANDBY_TAKEN, ReadIndex
from shm.segment import Segment

__all__ = ["Attachment"]

_U8 = np.dtype(np.uint8)
_MAX_HINTS = 1 << 16  # per client: about 10 MB of Python objects at most
_MIN_HINTS = 1 << 12


class Attachment:
    """A client's mapping of the owner's segment, checked against the owner's welcome."""

    def __init__(
        self, welcome: Welcome, expected_owner_id: str | None, *, optimistic_reads: bool = True,
        register_cuda: bool = True,
    ) -> None:
        """``optimistic_reads``: read through the segment's read index where it can (see
        ``shm.read_index``; needs x86-64 and a hit cell from the owner), else lease.
        ``register_cuda``: pin the mapping for CUDA on the first GPU tensor
        (``shm.client._cuda``)."""
        if expected_owner_id is not None and welcome.owner_id != expected_owner_id:
            raise ForeignSegmentError(
                f"the owner on this socket is {welcome.owner_id!r}, expected "
                f"{expected_owner_id!r}"
            )
        self.welcome = welcome
        self.segment = Segment.attach(welcome.segment, welcome.owner_id)
        header = self.segment.header
        if (header.block_bytes, header.num_slots, header.dtype, header.layout) != (
            welcome.block_bytes, welcome.num_slots, welcome.dtype, welcome.layout,
        ):
            self.segment.close()
            raise HeaderCorruptError(
                f"segment {welcome.segment} header ({header.block_bytes} bytes × "
                f"{header.num_slots} slots, {header.dtype}, {header.layout}) disagrees with "
                f"its owner ({welcome.block_bytes} × {welcome.num_slots}, {welcome.dtype}, "
                f"{welcome.layout})"
            )
        self.format = BlockFormat(welcome.block_bytes, welcome.dtype)
        self._rows: np.ndarray | None = self.segment.slots[:, : welcome.block_bytes]
        self._generations: np.ndarray | None = self.segment.generations
        self._cuda = CudaMapping(self.segment.slots, enabled=register_cuda)  # padding too
        self._index: ReadIndex | None = None
        if optimistic_reads and OPTIMISTIC_READS_SUPPORTED and welcome.hit_cell >= 0:
            self._index = self.segment.index
        self._hits = 0  # optimistic hits so far, mirrored into our hit cell
        self._publications = 0  # puts published so far, mirrored into our publish cell
        self._publish_lock = threading.Lock()
        # Block hash → slot last seen holding it (a hint; the read index holds the namespace
        # too, so hints need not: an int key is cheaper to hash than a tuple).
        self._where: dict[int, int] = {}
        # Trimmed in halves: at least a few thousand, so small stores trim seldom too.
        self._hint_limit = min(max(2 * welcome.num_slots, _MIN_HINTS), _MAX_HINTS)

    @property
    def reads_optimistically(self) -> bool:
        return self._index is not None

    def read_optimistic(self, keys: Sequence[BlockKey], checked: list[Any]) -> list[bool]:
        """Copy the blocks the read index holds into ``checked`` outputs, without the owner.

        Per key, whether its block was copied and validated (its slot was not retracted
        during the copy). Any other key must be read through the owner; its ``outs`` entry
        may have been written. Thread-safe; the caller then reports the hits
        (``count_hits``).
        """
        rows, read = self.rows(), self.format.read
        self._cuda.prepare(checked)

        def copy(i: int, slot: int) -> None:
            out = checked[i]
            if type(out) is np.ndarray and out.ndim == 1 and out.dtype is _U8:
                out[:] = rows[slot]  # the common case, inline: one call less per block
            else:
                read(rows, slot, out)

        return self._read_through_index(keys, copy)

    def read_views_optimistic(
        self, keys: Sequence[BlockKey], copy: Callable[[int, np.ndarray], None],
    ) -> list[bool]:
        """``read_optimistic`` with the copy left to ``copy(i, read-only view)``."""
        rows = self.rows()

        def copy_view(i: int, slot: int) -> None:
            view = rows[slot].view()
            view.flags.writeable = False
            copy(i, view)

        return self._read_through_index(keys, copy_view)

    def _read_through_index(
        self, keys: Sequence[BlockKey], copy_slot: Callable[[int, int], None],
    ) -> list[bool]:
        index = self._index
        if index is None:
            raise ClientDetachedError("the client is closed or does not read optimistically")
        try:
            return index.read(keys, self._where, copy_slot)
        except (TypeError, IndexError) as exc:
            raise TypeError("keys must be (namespace_seed, block_hash) pairs") from exc

    def known_held(self, keys: Sequence[BlockKey]) -> list[bool] | None:
        """Per key, whether the read index shows it where we last saw it, i.e. the store
        held it as we looked (all ``False`` at once for a writer's fresh keys); ``None`` when
        the client does not read optimistically."""
        if self._index is None:
            return None
        try:
            return self._index.shows(keys, self._where)
        except (TypeError, IndexError) as exc:
            raise TypeError("keys must be (namespace_seed, block_hash) pairs") from exc

    def write_to(self, slots: Sequence[int], arrays: Sequence[Any]) -> None:
        """Copy ``arrays[i]`` (checked) into ``slots[i]``."""
        rows, write = self.rows(), self.format.write
        self._cuda.prepare(arrays)
        for slot, array in zip(slots, arrays, strict=True):
            if type(array) is np.ndarray and array.ndim == 1 and array.dtype is _U8:
                rows[slot] = array  # the common case, inline: one call less per block
            else:
                write(rows, slot, array)

    def commit_filled(self, keys: Sequence[BlockKey], reply: Slots,
                      hashes: Sequence[int] | None = None) -> Publish | None:
        """Commit a reservation: the slots of ``reply`` (one per key; ``None``: none),
        reserved to us, now hold ``keys``' bytes (copied in, or filled in place).

        Every put commits this way: publishing the slots in the read index commits them
        with no message (see ``shm.read_index``); they are kept as hints (``hashes``: the
        keys' block hashes, if the caller has them at hand). A client that does not read
        optimistically gets the one-way ``Publish`` to send instead (``None``: nothing to
        send)."""
        if self._index is None:
            held, generations = descriptors(reply)
            return Publish(held, generations) if held else None
        self.publish(keys, reply.slots, hashes)
        return None

    def publish(self, keys: Sequence[BlockKey], slots: Sequence[int | None],
                hashes: Sequence[int] | None = None) -> None:
        """Publish filled ``slots`` (one per key; ``None``: none) in the read index, count
        the publication and keep them as hints (see ``commit_filled``)."""
        index = self._index
        if index is None:
            raise ClientDetachedError("the client is closed or does not read optimistically")
        index.publish(slots, keys)
        with self._publish_lock:  # the owner looks for commits when the count moves
            self._publications += 1
            index.count_publication(self.welcome.hit_cell, self._publications)
        self._hint(keys, slots, hashes)

    def hinted_slots(self, keys: Sequence[BlockKey]) -> set[int]:
        """The slots our hints place ``keys`` in."""
        where = self._where
        return {slot for key in keys if (slot := where.get(key[1])) is not None}

    @property
    def takes_standby(self) -> bool:
        """Whether we can take standby grants (the read index and the atomic swap)."""
        return self._index is not None and self.welcome.hit_cell >= 0 and ATOMIC_AVAILABLE

    def take_standby(self, want: int) -> tuple[int, list[int]] | None:
        """Take our standby grant (``shm.owner.store.standby``) if the owner offers one of at
        least ``want`` slots: its epoch and slots, now ours to overwrite (``None``: none
        offered, too small, or taken back as we swapped)."""
        index, cell = self._index, self.welcome.hit_cell
        if index is None or cell < 0 or not ATOMIC_AVAILABLE:
            return None
        epoch, _ = index.offered(cell, want)
        if not epoch or not index.swap_standby(cell, epoch, STANDBY_TAKEN):
            return None
        return epoch, index.grant_slots(cell)  # ours now: the owner changes it no more

    def retract(self, slots: Sequence[int]) -> None:
        """Make standby ``slots`` we took unreadable before we overwrite them."""
        if self._index is not None:
            self._index.unpublish(slots)

    def overwritten(self, epoch: int, keys: Sequence[BlockKey], slots: Sequence[int],
                    hashes: Sequence[int] | None, parents: Sequence[int | None] | None
                    ) -> None:
        """Commit ``keys``, copied into ``slots`` of our taken standby grant ``epoch``,
        with no message: record them for the owner (slots, parents), publish them, mark
        the grant DONE, then count the publication, after which the owner picks the
        record up before any request it handles and on its poll."""
        index, cell = self._index, self.welcome.hit_cell
        if index is None:
            raise ClientDetachedError("the client is closed or does not read optimistically")
        index.record_overwrite(cell, slots, parents)
        index.publish(slots, keys)
        index.done_standby(cell, epoch)
        with self._publish_lock:
            self._publications += 1
            index.count_publication(cell, self._publications)
        if keys:
            self._hint(keys, slots, hashes)

    def remember(self, keys: Sequence[BlockKey], reply: Slots) -> None:
        """Keep where the owner found keys, as hints for later optimistic reads."""
        if self._index is not None:
            self._hint(keys, reply.slots)

    def _hint(self, keys: Sequence[BlockKey], slots: Sequence[int | None],
              hashes: Sequence[int] | None = None) -> None:
        where = self._where
        if None in slots:
            for slot, key in zip(slots, keys, strict=True):
                if slot is not None:
                    where[key[1]] = slot
        else:
            where.update(zip(hashes if hashes is not None else [key[1] for key in keys],
                             slots, strict=True))  # type: ignore[arg-type]
        if len(where) > self._hint_limit:
            self._trim_hints()

    def _trim_hints(self) -> None:
        """Hints outlive evictions and cost memory: past the limit, keep the newest half, in
        a new dict (cheaper than popping the oldest one by one; one C call, so no other
        thread changes the old one meanwhile, though one may add a hint to it just after,
        which is lost: that costs a lease at most)."""
        where, limit = self._where, self._hint_limit
        if len(where) > limit:
            self._where = dict(itertools.islice(where.items(), len(where) - limit // 2, None))

    def count_hits(self, count: int) -> None:
        """Add optimistic hits to our cell (the caller serializes calls: one writer)."""
        if self._index is not None and count:
            self._hits += count
            self._index.hit_cells[self.welcome.hit_cell] = self._hits

    def rows(self) -> np.ndarray:
        if self._rows is None:
            raise ClientDetachedError("the client is closed")
        return self._rows

    def check_generations(self, slots: list[int], generations: list[int]) -> None:
        """Raise ``StaleDescriptorError`` if any slot was reused since it was handed out."""
        if self._generations is None:
            raise ClientDetachedError("the client is closed")
        if not slots:
            return
        current = self._generations[slots]
        if not np.array_equal(current, np.asarray(generations, dtype=np.uint64)):
            bad = [s for s, g, c in zip(slots, generations, current.tolist(), strict=True)
                   if g != c]
            raise StaleDescriptorError(f"slots {bad} were reused while held")

    # ------------------------------------------------------------------ copies
    def check_blocks(self, arrays: Sequence[Any], count: int, *, out: bool) -> list[Any]:
        if len(arrays) != count:
            raise ValueError(f"{len(arrays)} arrays for {count} keys")
        fmt = self.format
        check = fmt.check_out if out else fmt.check
        nbytes, dtype = fmt.block_bytes, fmt.dtype
        checked = []
        for i, a in enumerate(arrays):
            if (type(a) is np.ndarray and a.nbytes == nbytes  # the common case, inline
                    and (a.dtype is _U8 or a.dtype.name == dtype)
                    and (not out or a.flags.writeable)):
                checked.append(a)
            else:
                checked.append(check(a, f"block {i}"))
        return checked

    def write_blocks(self, reply: Slots, arrays: list[Any]) -> tuple[list[int], list[int]]:
        """Copy the arrays whose keys got a slot; return the descriptors written."""
        slots, gens = descriptors(reply)
        self.write_to(slots, arrays if len(slots) == len(arrays) else
                      [a for a, s in zip(arrays, reply.slots, strict=True) if s is not None])
        return slots, gens

    def read_blocks(self, reply: Slots, outs: list[Any]) -> tuple[list[int], list[int]]:
        """Copy the leased slots into ``outs``; return the descriptors to release."""
        rows = self.rows()
        read = self.format.read
        slots: list[int] = []
        gens: list[int] = []
        self._cuda.prepare(outs)
        for i, slot in enumerate(reply.slots):
            if slot is not None:
                read(rows, slot, outs[i])
                slots.append(slot)
                gens.append(reply.generations[i])  # type: ignore[arg-type]
        self.check_generations(slots, gens)
        return slots, gens

    def views(self, reply: Slots, *, writable: bool) -> list[np.ndarray | None]:
        rows = self.rows()
        views: list[np.ndarray | None] = []
        for slot in reply.slots:
            if slot is None:
                views.append(None)
                continue
            view = rows[slot]
            view = view.view()
            view.flags.writeable = writable
            views.append(view)
        return views

    def close(self) -> None:
        self._cuda.close()  # while the mapping is still there
        self._rows = None
        self._generations = None
        self._index = None
        self.segment.close()

