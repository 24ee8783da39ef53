"""A prefix index as its own packed arrays: the snapshot a restarting gateway loads fast.

``IndexSnapshot`` (``kvcore.events``) lists every block of every worker as Python objects,
and rebuilding 1 M blocks from it replays each through ``BlockTable.store``: seconds. An
``IndexImage`` is each tier's ``BlockTable.nodes`` written out column by column, as
little-endian arrays: the block hashes, each packed value's high part (the parent's hash)
and its low part (the holder and child-holder bits, ``2 × width`` of them), plus the
branch-point counts (``multi``) and each worker's counters. Loading it is three array reads,
one pass joining high and low, and one dict build per tier (``scripts/bench_warm_start.py``).

The layout is the table's own (``block_table.py``), so an image is read back only by the
same ``IMAGE_VERSION``. Reading refuses, with ``WireError``, an image that does not hold
together (columns of unequal length, a holder bit of no worker, a slot twice), so a bad
snapshot costs a cold start, never a corrupt index.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import reduce
from itertools import repeat
from operator import and_, lshift, or_, rshift
from typing import Annotated

import msgspec
from msgspec import Meta

from kvcore.events import Counter, Tier, WorkerId
from kvcore.wire import WireError
from routing.placement.block_table import BlockTable
from routing.placement.index_stats import IndexStats

__all__ = ["IMAGE_VERSION", "IndexImage", "TableImage", "WorkerImage", "pack_tables",
           "unpack_tables"]

IMAGE_VERSION = 1
_MAX_WIDTH = 1 << 16  # worker slots; far past any fleet, small enough to refuse nonsense
_M64 = (1 << 64) - 1
_SLICE = 1 << 15  # entries per C loop while packing (a few milliseconds)
_BIG_ENDIAN = sys.byteorder == "big"
Slot = Annotated[int, Meta(ge=0, lt=_MAX_WIDTH)]


class WorkerImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One worker: its slot (its bit in the tables), stream position and per-tier counts."""

    worker_id: WorkerId
    slot: Slot
    epoch: Counter
    seq: Counter
    needs_resync: bool
    blocks: list[Counter]  # per tier
    orphans: list[Counter]  # per tier


class TableImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One tier's table, column by column (entry ``i`` is ``keys[i] → parents[i], bits[i]``)."""

    keys: bytes  # u64 block hashes
    parents: bytes  # u64: the value's bits above the holder bits (parent, self or 0)
    bits: bytes  # holder and child-holder bits: u16, u32 or u64 words (``_columns``)
    multi: list[tuple[int, list[tuple[Slot, Counter]]]]  # branch points: block → (slot, n)


class IndexImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The whole index: the tables' width (worker slots), its workers and one table per tier."""

    version: int
    width: Annotated[int, Meta(ge=8, le=_MAX_WIDTH)]
    workers: list[WorkerImage]
    tables: list[TableImage]


def _columns(width: int) -> tuple[str, int]:
    """The array type code of the low bits, and how many words of it an entry takes."""
    bits = 2 * width
    if bits <= 16:
        return "H", 1
    if bits <= 32:
        return "I" if array("I").itemsize == 4 else "L", 1
    return "Q", bits // 64


def _to_bytes(column: array[int]) -> bytes:
    if _BIG_ENDIAN:
        column.byteswap()
    return column.tobytes()


def _from_bytes(code: str, raw: bytes, count: int, what: str) -> array[int]:
    column = array(code)
    if len(raw) != count * column.itemsize:
        raise WireError(f"index image: {what} holds {len(raw)} bytes, expected "
                        f"{count} × {column.itemsize}")
    column.frombytes(raw)
    if _BIG_ENDIAN:
        column.byteswap()
    return column


def pack_tables(tables: Sequence[BlockTable]) -> list[TableImage]:
    """Each table's entries as columns. Every column is built by C loops over slices of
    ``_SLICE`` entries, so a thread packing lets the event loop in between them."""
    out = []
    for table in tables:
        nodes, width = table.nodes, table.width
        shift = 2 * width
        keys, values = list(nodes), list(nodes.values())
        code, words = _columns(width)
        if words == 1:
            bits = _to_bytes(_column(code, values, (and_, (1 << shift) - 1)))
        else:  # wider than 64 bits: one column per 64-bit word, lowest first
            bits = b"".join(_to_bytes(_column("Q", values, (rshift, 64 * w), (and_, _M64)))
                            for w in range(words))
        multi = [(block, [(bit.bit_length() - 1, n) for bit, n in counts.items()])
                 for block, counts in table.multi.items()]
        out.append(TableImage(_to_bytes(_column("Q", keys)),
                              _to_bytes(_column("Q", values, (rshift, shift))), bits, multi))
    return out


def _column(code: str, source: list[int],
            *steps: tuple[Callable[[int, int], int], int]) -> array[int]:
    """``source`` with each step ``(op, arg)`` applied in turn (``op(value, arg)``)."""
    column = array(code)
    for start in range(0, len(source), _SLICE):
        part: Iterator[int] = iter(source[start : start + _SLICE])
        for op, arg in steps:
            part = map(op, part, repeat(arg))
        column.extend(part)
    return column


def unpack_tables(image: IndexImage, stats: IndexStats) -> list[BlockTable]:
    """One ``BlockTable`` per tier, as the image had them; ``WireError`` if it is not whole."""
    if image.version != IMAGE_VERSION:
        raise WireError(f"index image version {image.version}, expected {IMAGE_VERSION}")
    width = image.width
    if width & (width - 1):
        raise WireError(f"index image width {width} is not a power of two")
    if len(image.tables) != len(Tier):
        raise WireError(f"index image has {len(image.tables)} tables, expected {len(Tier)}")
    slots = [w.slot for w in image.workers]
    if len(set(slots)) != len(slots) or any(s >= width for s in slots):
        raise WireError(f"index image worker slots {slots} repeat or exceed width {width}")
    if len({w.worker_id for w in image.workers}) != len(slots):
        raise WireError("index image names a worker twice")
    if any(len(w.blocks) != len(Tier) or len(w.orphans) != len(Tier) for w in image.workers):
        raise WireError(f"index image workers must have counts for {len(Tier)} tiers")
    live = sum(1 << s for s in slots)
    stray = ~(live | live << width)
    code, words = _columns(width)
    shift = 2 * width
    tables = []
    for t, part in enumerate(image.tables):
        count = len(part.keys) // 8
        keys = _from_bytes("Q", part.keys, count, "keys").tolist()
        parents = _from_bytes("Q", part.parents, count, "parents")
        if words == 1:
            low: array[int] | list[int] = _from_bytes(code, part.bits, count, "bits")
        else:
            cols = _from_bytes("Q", part.bits, count * words, "bits")
            low = cols[:count].tolist()
            for w in range(1, words):
                word = cols[w * count : (w + 1) * count]
                low = list(map(or_, low, map(lshift, word, repeat(64 * w))))
        if reduce(or_, low, 0) & stray:
            raise WireError(f"index image tier {t} has holder bits of no worker")
        nodes = dict(zip(keys, map(or_, map(lshift, parents, repeat(shift)), low), strict=True))
        if len(nodes) != count:
            raise WireError(f"index image tier {t} repeats a block hash")
        multi: dict[int, dict[int, int]] = {}
        for block, counts in part.multi:
            if block not in nodes or any(s not in slots or n < 2 for s, n in counts):
                raise WireError(f"index image tier {t} has a bad branch point {block}")
            multi[block] = {1 << s: n for s, n in counts}
        dirty = sum(1 << w.slot for w in image.workers if w.orphans[t])
        table = BlockTable(stats, width)
        table.adopt(nodes, multi, dirty)
        tables.append(table)
    return tables
