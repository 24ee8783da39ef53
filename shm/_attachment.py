"""What the sync and async clients share: the attached segment, request building, replies.

The clients differ only in how a frame crosses the socket; everything about blocks (shape
checks, copies into and out of slot views, generation checks, turning ``ErrorReply`` into
the right exception) lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from shm._blocks import BlockFormat
from shm.errors import (
    ClientDetachedError,
    ForeignSegmentError,
    HeaderCorruptError,
    ProtocolError,
    StaleDescriptorError,
    error_from_code,
)
from shm.protocol import ErrorReply, Reply, Slots, StatsReply, Welcome
from shm.segment import Segment
from shm.store import BlockKey, StoreStats

__all__ = ["Attachment", "BlockKey", "expect", "split_keys", "stats_from_reply"]

R = TypeVar("R")


def expect(reply: Reply, kind: type[R]) -> R:
    """``reply`` if it is a ``kind``; the error it carries, or ``ProtocolError``, if not."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    raise ProtocolError(f"expected a {kind.__name__} reply, got {type(reply).__name__}")


def split_keys(keys: Sequence[BlockKey]) -> tuple[list[int], list[int]]:
    """``[(namespace_seed, block_hash), ...]`` as the two flat lists the wire carries."""
    try:
        return [k[0] for k in keys], [k[1] for k in keys]
    except (TypeError, IndexError) as exc:
        raise TypeError("keys must be (namespace_seed, block_hash) pairs") from exc


def stats_from_reply(reply: StatsReply) -> StoreStats:
    return StoreStats(*(getattr(reply, name) for name in StatsReply.__struct_fields__))


class Attachment:
    """A client's mapping of the owner's segment, checked against the owner's welcome."""

    def __init__(self, welcome: Welcome, expected_owner_id: str | None) -> None:
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
        check = self.format.check_out if out else self.format.check
        return [check(a, f"block {i}") for i, a in enumerate(arrays)]

    def write_blocks(self, reply: Slots, arrays: list[Any]) -> tuple[list[int], list[int]]:
        """Copy the arrays whose keys got a slot; return the descriptors written."""
        rows = self.rows()
        write = self.format.write
        slots: list[int] = []
        gens: list[int] = []
        for i, slot in enumerate(reply.slots):
            if slot is not None:
                write(rows, slot, arrays[i])
                slots.append(slot)
                gens.append(reply.generations[i])  # type: ignore[arg-type]
        return slots, gens

    def read_blocks(self, reply: Slots, outs: list[Any]) -> tuple[list[int], list[int]]:
        """Copy the leased slots into ``outs``; return the descriptors to release."""
        rows = self.rows()
        read = self.format.read
        slots: list[int] = []
        gens: list[int] = []
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
        self._rows = None
        self._generations = None
        self.segment.close()


def descriptors(reply: Slots) -> tuple[list[int], list[int]]:
    """The (slots, generations) of the keys that got one."""
    pairs = [(s, g) for s, g in zip(reply.slots, reply.generations, strict=True) if s is not None]
    return [s for s, _ in pairs], [g for _, g in pairs]  # type: ignore[misc]
