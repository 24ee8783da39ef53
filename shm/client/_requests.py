"""What each client operation sends, and what its reply carries: shared by every client.

Keys travel as two flat lists (namespace seeds and block hashes), slot descriptors as two
(slots and generations), a put's parents and tokens beside its keys. The clients
(``BlockStoreClient``, ``AsyncBlockStoreClient``, ``AsyncSegmentReader``, ``LocalSession``)
build their requests here and differ only in how the frames travel (``shm.client._transport``).
Meant to be imported as a namespace: ``req.lease(keys)``, ``req.release(reply)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shm.owner.store import BlockKey
from shm.protocol import Abort, Contains, Lease, Ping, Release, Remove, Slots, Stats

__all__ = [
    "PING",
    "STATS",
    "Fields",
    "Parents",
    "Tokens",
    "abort",
    "contains",
    "descriptors",
    "lease",
    "pick",
    "put_fields",
    "release",
    "remove",
    "split_keys",
]

PING = Ping()
STATS = Stats()

Parents = Sequence[int | None] | None
"""A put's parent hashes, one per key (``None``: a chain's first block), for its event."""
Tokens = Sequence[list[int] | None] | None
"""A put's token ids, one list per key, for its event."""
Fields = tuple[list[int], list[int], list[int | None] | None, list[list[int] | None] | None]
"""A put's namespaces, hashes, parents and tokens, as ``Reserve`` and ``Claim`` carry them."""


def split_keys(keys: Sequence[BlockKey]) -> tuple[list[int], list[int]]:
    """``[(namespace_seed, block_hash), ...]`` as the two flat lists the wire carries."""
    try:
        return [k[0] for k in keys], [k[1] for k in keys]
    except (TypeError, IndexError) as exc:
        raise TypeError("keys must be (namespace_seed, block_hash) pairs") from exc


def lease(keys: Sequence[BlockKey]) -> Lease:
    return Lease(*split_keys(keys))


def contains(keys: Sequence[BlockKey]) -> Contains:
    return Contains(*split_keys(keys))


def remove(keys: Sequence[BlockKey]) -> Remove:
    return Remove(*split_keys(keys))


def descriptors(reply: Slots) -> tuple[list[int], list[int]]:
    """The (slots, generations) of the keys that got one."""
    if None not in reply.slots:  # the common case: every key got one
        return reply.slots, reply.generations  # type: ignore[return-value]
    pairs = [(s, g) for s, g in zip(reply.slots, reply.generations, strict=True) if s is not None]
    return [s for s, _ in pairs], [g for _, g in pairs]  # type: ignore[misc]


def release(reply: Slots) -> Release | None:
    """The one-way frame giving back what a lease's ``reply`` pinned (``None``: nothing)."""
    slots, generations = descriptors(reply)
    return Release(slots, generations) if slots else None


def abort(reply: Slots) -> Abort | None:
    """The request dropping what a reservation's ``reply`` holds (``None``: nothing)."""
    slots, generations = descriptors(reply)
    return Abort(slots, generations) if slots else None


def put_fields(keys: Sequence[BlockKey], parents: Parents, tokens: Tokens) -> Fields:
    """A put's namespaces, hashes, parents and tokens, as the wire carries them."""
    namespaces, hashes = split_keys(keys)
    if parents is not None and len(parents) != len(keys):
        raise ValueError(f"{len(parents)} parent_hashes for {len(keys)} keys")
    if tokens is not None and len(tokens) != len(keys):
        raise ValueError(f"{len(tokens)} token_ids for {len(keys)} keys")
    # Lists go as they are (encoded at once, never kept); other sequences are copied.
    return (namespaces, hashes,
            parents if parents is None or type(parents) is list else list(parents),
            tokens if tokens is None or type(tokens) is list else list(tokens))


def pick(fields: Fields, indices: Sequence[int], whole: bool) -> Fields:
    """The namespaces, hashes, parents and tokens of the keys at ``indices`` (``whole``:
    every key, in order: taken as they are)."""
    if whole:
        return fields
    return tuple(  # type: ignore[return-value]
        None if values is None else [values[i] for i in indices] for values in fields)
