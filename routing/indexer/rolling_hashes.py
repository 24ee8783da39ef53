"""The RFC's XXH3 rolling sequence hashes, kept for every indexed block so ``/query_by_hash``
answers a client that hashes as the RFC says (Mooncake RFC #1403 and #1527; Dynamo's scheme).

The scheme, for one namespace, with seed ``S`` (Dynamo's ``XXH3_SEED``, 1337, by default)::

    local[i]    = XXH3_64(tokens of block i as little-endian u32, S)
    seq_hash[0] = local[0]
    seq_hash[i] = XXH3_64(seq_hash[i-1] as LE u64 || local[i] as LE u64, S)

Our index keys blocks by canonical hashes (``kvcore.hashing``), which cannot be computed from
an XXH3 hash, so ``RollingHashMap`` learns the translation at ingest: it watches what the
``PrefixIndex`` applies (an ``IndexObserver``) and, for each stored block, computes its
``seq_hash`` from the event's token ids (continuing from its parent's) and files
``(namespace seed, seq_hash) → canonical hash``. The namespace seed of a chain is recovered
from its first block (``BlockHasher.root_seed``), since events name no namespace; a query
names one (model, LoRA adapter, salt), so identical tokens in two namespaces stay apart.

A snapshot (a first subscription to a warm worker, a resync) is learned the same way: a
sidecar's snapshot carries each block's token ids (``TierBlocks.token_ids``, kept by its
mirror), and its chains are hashed a run of consecutive blocks at a time.

An entry lives while some (worker, tier) holds its block: removals, cleared tiers, a worker
gone or restarted take it out with the last holder. A block stored without token ids (a
tier move, a relay that strips them), or listed without them by a snapshot (an older
sidecar's; the block's events carried none), counts as held when its translation is known
from another holder; otherwise it is counted in ``blocks_untranslated`` and
``/query_by_hash`` stops there until it is stored again with its tokens. A block whose
parent's ``seq_hash`` is unknown keeps its tokens, pending, until the parent's is learned.
An index image (``PrefixIndex.load_image``) carries no tokens: see docs/indexer-api.md.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvcore import BlockHasher
from kvcore.events import BlockRemoved, BlockStored, KVEvent, Tier, TierBlocks, WorkerSnapshot
from kvcore.wire import pack_le, unpack_le

__all__ = ["DEFAULT_XXH3_SEED", "RollingHashMap", "rolling_hashes"]

DEFAULT_XXH3_SEED = 1337  # Dynamo's XXH3_SEED: the RFC leaves S open
_U64 = (1 << 64) - 1
_MAX_BLOCK_SIZE = 4096  # BlockHasher's bound
_PAIR = struct.Struct("<QQ")
_xxh3 = xxhash.xxh3_64_intdigest


def rolling_hashes(token_ids: Sequence[int], block_size: int, seed: int,
                   parent: int | None = None) -> list[int]:
    """The ``seq_hash`` of every full block of ``token_ids``, continuing after ``parent``
    (the ``seq_hash`` of the block before them; None: they start the sequence)."""
    raw = pack_le(token_ids[: len(token_ids) // block_size * block_size])
    step = 4 * block_size
    out = []
    for start in range(0, len(raw), step):
        local = _xxh3(raw[start : start + step], seed)
        parent = local if parent is None else _xxh3(_PAIR.pack(parent, local), seed)
        out.append(parent)
    return out


@dataclass(slots=True)
class _Entry:
    """One canonical block held somewhere: its XXH3 ``seq_hash`` and its chain's namespace
    seed, or, while its parent's ``seq_hash`` is unknown (it was stored under a parent no
    holder had hashed), what computing them needs: the parent and the block's tokens."""

    rolling: int | None
    namespace: int
    holders: int = 1
    parent: int | None = None  # pending only
    tokens: list[int] | None = None  # pending only


class RollingHashMap:
    """``(namespace seed, seq_hash) → canonical block hash`` for every held block whose
    tokens the index saw. Pure and synchronous; ``PrefixIndex.observer`` feeds it."""

    def __init__(self, seed: int = DEFAULT_XXH3_SEED) -> None:
        if not 0 <= seed <= _U64:
            raise ValueError(f"an XXH3 seed is a u64, got {seed}")
        self.seed = seed
        self.blocks_untranslated = 0  # stored blocks left without a seq_hash (see above)
        self._entries: dict[int, _Entry] = {}  # canonical hash → entry
        self._canonical: dict[tuple[int, int], int] = {}  # (namespace, seq_hash) → canonical
        self._waiting: dict[int, set[int]] = {}  # parent → its pending children
        self._held: dict[str, list[set[int]]] = {}  # worker → tier → canonical hashes counted
        self._hashers: dict[int, BlockHasher] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # --- queries --------------------------------------------------------------------------

    def canonical(self, namespace: int, seq_hashes: Sequence[int]) -> list[int]:
        """Our hashes of the leading ``seq_hashes`` that some worker holds, up to the first
        that none does (the blocks after it cannot be any worker's leading blocks)."""
        out = []
        table = self._canonical
        for rolling in seq_hashes:
            block = table.get((namespace, rolling))
            if block is None:
                break
            out.append(block)
        return out

    def num_translated(self, worker_id: str) -> int:
        """The (block, tier) pairs of ``worker_id`` whose ``seq_hash`` is known."""
        entries = self._entries
        return sum(entries[b].rolling is not None
                   for blocks in self._held.get(worker_id, ()) for b in blocks)

    # --- the IndexObserver side -----------------------------------------------------------

    def applied(self, event: KVEvent) -> None:
        """One event the index applied."""
        held = self._held.get(event.worker_id)
        if held is None:
            held = self._held[event.worker_id] = [set() for _ in Tier]
        tier_held = held[event.tier]
        if isinstance(event, BlockStored):
            self._stored(tier_held, event)
        elif isinstance(event, BlockRemoved):
            for block in event.block_hashes:
                if block in tier_held:
                    tier_held.discard(block)
                    self._release(block)
        else:
            for block in tier_held:
                self._release(block)
            tier_held.clear()

    def worker_reset(self, worker_id: str, snapshot: WorkerSnapshot | None) -> None:
        """The index replaced what ``worker_id`` holds: with ``snapshot`` (a resync: its blocks
        whose translation is known stay counted) or with nothing (gone, or a new epoch)."""
        held = self._held.pop(worker_id, None) or [set() for _ in Tier]
        kept: list[set[int]] = [set() for _ in Tier]
        if snapshot is not None:
            entries = self._entries
            for tier_blocks in snapshot.tiers:
                if tier_blocks.token_ids:
                    self._learn_snapshot(tier_blocks)
                known = {b for b in tier_blocks.block_hashes if b in entries}
                self.blocks_untranslated += len(tier_blocks.block_hashes) - len(known)
                kept[tier_blocks.tier] = known
            self._held[worker_id] = kept
        for tier in Tier:
            for block in kept[tier] - held[tier]:
                self._entries[block].holders += 1
            for block in held[tier] - kept[tier]:
                self._release(block)

    # --- internals ------------------------------------------------------------------------

    def _stored(self, tier_held: set[int], event: BlockStored) -> None:
        blocks = event.block_hashes
        tokens = event.token_ids
        parent = event.parent_hash
        if tokens is not None and blocks[0] == parent:  # as PrefixIndex: not its own child
            tokens = tokens[len(tokens) // len(blocks):]
            blocks = blocks[1:]
        block_size = len(tokens) // len(blocks) if tokens and blocks else 0
        entries = self._entries
        if not 1 <= block_size <= _MAX_BLOCK_SIZE:  # a move, a relay without tokens
            for block in blocks:
                if block in entries:
                    self._hold(tier_held, block)
                else:
                    self.blocks_untranslated += 1
            return
        assert tokens is not None
        new = [i for i, block in enumerate(blocks) if block not in entries]
        if new:  # engines store each block once: one run of new blocks, after known ones
            first = new[0]
            self._learn(blocks[first:], blocks[first - 1] if first else parent,
                        tokens[first * block_size:], block_size)
        for block in blocks:
            self._hold(tier_held, block)

    def _learn_snapshot(self, tier_blocks: TierBlocks) -> None:
        """Entries for a snapshot's blocks that carry token ids, a run of blocks at a time:
        a holder lists a chain stored in one event as consecutive blocks, each the next
        one's parent (a run's parent listed later, or not at all, leaves it pending)."""
        entries = self._entries
        run: list[int] = []
        raw = bytearray()
        parent: int | None = None
        size = 0
        for block, above, ids in zip(tier_blocks.block_hashes, tier_blocks.parent_hashes,
                                     tier_blocks.token_ids, strict=True):
            if run and (above != run[-1] or len(ids) != size):
                self._learn_raw(run, parent, raw)
                run, raw = [], bytearray()
            if not ids or block in entries or block == above:
                if run:
                    self._learn_raw(run, parent, raw)
                    run, raw = [], bytearray()
                continue
            if not run:
                parent, size = above, len(ids)
            run.append(block)
            raw += ids
        if run:
            self._learn_raw(run, parent, raw)

    def _learn_raw(self, blocks: list[int], parent: int | None, raw: bytearray) -> None:
        block_size = len(raw) // 4 // len(blocks)
        if not 1 <= block_size <= _MAX_BLOCK_SIZE:
            return
        self._learn(blocks, parent, unpack_le(raw), block_size)

    def _learn(self, blocks: Sequence[int], parent: int | None, tokens: list[int],
               block_size: int) -> None:
        """Entries for a chain of blocks (those known already are left as they are):
        translated when the parent's ``seq_hash`` is known or there is no parent, pending on
        the parent otherwise; then the pending blocks below each new one."""
        entries = self._entries
        above = None if parent is None else entries.get(parent)
        previous = None if above is None else above.rolling
        namespace = 0
        try:
            if parent is None:
                namespace = self._hasher(block_size).root_seed(blocks[0], tokens[:block_size])
            elif previous is not None:
                namespace = above.namespace  # type: ignore[union-attr]
            rolling = (None if parent is not None and previous is None
                       else rolling_hashes(tokens, block_size, self.seed, previous))
        except (ValueError, OverflowError):  # token ids no u32 (adapters check: never here)
            rolling = None
            parent = None
        for i, block in enumerate(blocks):
            if block in entries:
                parent = block
                continue
            if rolling is None:  # pending: wait for the parent's seq_hash
                entries[block] = _Entry(None, 0, 0, parent,
                                        tokens[i * block_size:(i + 1) * block_size])
                if parent is not None:
                    self._waiting.setdefault(parent, set()).add(block)
            else:
                entries[block] = _Entry(rolling[i], namespace, 0)
                self._canonical[(namespace, rolling[i])] = block
                if block in self._waiting:
                    self._resolve(block)
            parent = block

    def _resolve(self, block: int) -> None:
        """The pending blocks below ``block`` (now translated) get their ``seq_hash``."""
        todo = [block]
        while todo:
            current = todo.pop()
            above = self._entries[current]
            for child in self._waiting.pop(current, ()):
                entry = self._entries[child]
                assert entry.tokens is not None and above.rolling is not None
                (entry.rolling,) = rolling_hashes(entry.tokens, len(entry.tokens), self.seed,
                                                  above.rolling)
                entry.namespace, entry.parent, entry.tokens = above.namespace, None, None
                self._canonical[(entry.namespace, entry.rolling)] = child
                todo.append(child)

    def _hold(self, tier_held: set[int], block: int) -> None:
        if block not in tier_held:
            tier_held.add(block)
            self._entries[block].holders += 1

    def _release(self, block: int) -> None:
        entry = self._entries[block]
        entry.holders -= 1
        if entry.holders:
            return
        del self._entries[block]
        if entry.rolling is not None:
            key = (entry.namespace, entry.rolling)
            if self._canonical.get(key) == block:
                del self._canonical[key]
        elif entry.parent is not None:
            waiting = self._waiting.get(entry.parent)
            if waiting is not None:
                waiting.discard(block)
                if not waiting:
                    del self._waiting[entry.parent]

    def _hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size)
        return hasher
