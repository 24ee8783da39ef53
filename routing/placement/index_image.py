"""A prefix index as its own packed arrays: the snapshot a restarting gateway loads fast.

``IndexSnapshot`` (``kvcore.events``) lists every block of every worker as Python objects,
and rebuilding 1 M blocks from it replays each through ``WorkerBlocks.store``: seconds. An
``IndexImage`` is each worker's ``block → parent`` dicts (``worker_blocks.py``) written out
as little-endian arrays: the block hashes in the dict's order and, per block, its parent's
position among them (a root points at itself; a parent the worker does not hold is a
position past the end, into a short array of such hashes). Positions, not hashes, so that a
loaded dict's values are its own key objects again (no int of their own: the memory the
live index has). Loading is two array reads, one C pass mapping positions to keys and one
dict build per worker and tier (``scripts/bench_warm_start.py``).

The layout is the index's own, so an image is read back only by the same ``IMAGE_VERSION``
(version 1, one packed table per tier, is refused: the gateway cold-starts). Reading
refuses, with ``WireError``, an image that does not hold together (arrays of unequal length,
a position out of range, a hash twice, a slot twice), so a bad snapshot costs a cold start,
never a corrupt index.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, count
from operator import eq
from typing import Annotated, cast

import msgspec
from msgspec import Meta

from kvcore.events import Counter, WorkerId
from kvcore.wire import WireError, pack_le, unpack_le

__all__ = ["IMAGE_VERSION", "IndexImage", "TierImage", "WorkerImage", "pack_worker",
           "unpack_workers"]

IMAGE_VERSION = 2
_MAX_SLOTS = 1 << 16  # worker slots; far past any fleet, small enough to refuse nonsense
Slot = Annotated[int, Meta(ge=0, lt=_MAX_SLOTS)]


class TierImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One worker's blocks in one tier: ``keys[i]``'s parent is ``(keys + lost)[parents[i]]``
    (itself for a root)."""

    keys: bytes  # u64 block hashes, in the dict's order
    parents: bytes  # u32 positions
    lost: bytes  # u64 hashes of parents the worker does not hold


class WorkerImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One worker: its slot (its bit in the holder masks), stream position, blocks per tier."""

    worker_id: WorkerId
    slot: Slot
    epoch: Counter
    seq: Counter
    needs_resync: bool
    tiers: list[TierImage]


class IndexImage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The whole index: its version, then its workers."""

    version: int
    workers: list[WorkerImage]


def pack_worker(worker_id: str, slot: int, epoch: int, seq: int, needs_resync: bool,
                tiers: Sequence[dict[int, int]]) -> WorkerImage:
    """One worker's ``block → parent`` dicts (one per tier) as arrays. Each is a few C
    passes over one worker's blocks: a thread packing lets the event loop in between."""
    out = []
    for par in tiers:
        keys = list(par)
        where = dict(zip(keys, count()))
        found = list(map(where.get, par.values()))
        lost: list[int] = []
        if None in found:  # parents it does not hold: positions past the end
            values = list(par.values())
            for i in compress(count(), map(eq, found, [None] * len(found))):
                found[i] = len(keys) + len(lost)
                lost.append(values[i])
        parents = cast(list[int], found)
        out.append(TierImage(pack_le(keys, 8), pack_le(parents), pack_le(lost, 8)))
    return WorkerImage(worker_id, slot, epoch, seq, needs_resync, out)


def unpack_workers(image: IndexImage,
                   num_tiers: int) -> list[list[tuple[dict[int, int], list[int]]]]:
    """Per worker of the image, per tier: its ``block → parent`` dict, whose values are its
    own key objects, and its roots; ``WireError`` if the image does not hold together."""
    if image.version != IMAGE_VERSION:
        raise WireError(f"index image version {image.version}, expected {IMAGE_VERSION}")
    slots = [w.slot for w in image.workers]
    if len(set(slots)) != len(slots):
        raise WireError(f"index image worker slots {slots} repeat")
    if len({w.worker_id for w in image.workers}) != len(slots):
        raise WireError("index image names a worker twice")
    loaded = []
    for w in image.workers:
        if len(w.tiers) != num_tiers:
            raise WireError(f"index image worker {w.worker_id!r} has {len(w.tiers)} tiers, "
                            f"expected {num_tiers}")
        tiers = []
        for t, part in enumerate(w.tiers):
            keys = unpack_le(part.keys, 8, "index image keys")
            parents = unpack_le(part.parents, 4, "index image parents")
            if len(parents) != len(keys):
                raise WireError(f"index image worker {w.worker_id!r} tier {t}: "
                                f"{len(keys)} blocks, {len(parents)} parents")
            table = keys + unpack_le(part.lost, 8, "index image lost parents")
            try:
                values = list(map(table.__getitem__, parents))
            except IndexError:
                raise WireError(f"index image worker {w.worker_id!r} tier {t} has a parent "
                                "position out of range") from None
            par = dict(zip(keys, values, strict=True))
            if len(par) != len(keys):
                raise WireError(f"index image worker {w.worker_id!r} tier {t} repeats a "
                                "block hash")
            roots = list(compress(keys, map(eq, parents, count())))
            tiers.append((par, roots))
        loaded.append(tiers)
    return loaded
