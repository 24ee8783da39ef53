"""The shared normalizer: one worker's native block operations → canonical events.

Every adapter decodes its engine's wire format into three engine-neutral operations and
hands them to a ``WorkerNormalizer``, which owns everything both engines share:

* **canonical hashes**: stored tokens are re-hashed with ``BlockHasher`` under the
  namespace (model id, LoRA name, cache salt), chained to the canonical hash of the engine
  parent; the engine's own block hashes stay the keys of a per-tier map
  ``engine hash → (canonical hash, canonical parent, chain state)``, so removals (which carry
  only engine hashes) resolve, and a child continues a
  batched chain from its kept state without inverting the parent's hash;
* **resyncs, signalled explicitly**: ``resync()`` (engine restart, lost events) forgets
  everything and emits ``AllBlocksCleared`` so consumers drop the worker's old blocks. Events
  leave unstamped (epoch and seq 0): the sidecar's relay is the one place that numbers them;
* **conservative gaps**: a stored chain whose engine parent is unknown (it was stored
  before we joined, or lost) is *orphaned* — counted, not published — because its canonical
  hashes cannot be computed; a partial block (and every block after it) is skipped. The
  published state is therefore always a subset of what the engine holds;
* **names for the store**: ``store_names``, when set, hears every chain stored as
  (engine hashes, canonical hashes, canonical parent), so the sidecar's block store can name
  the blocks the engine's storage hook keys by engine hash (``shm.block_names``).

Pure and synchronous: no I/O, no asyncio; the adapters' I/O shells drive it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from adapters.normalize_hashing import block_locals, chain_states
from adapters.normalize_metrics import AdapterMetrics
from kvcore.events import (
    UNSTAMPED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
)
from kvcore.hashing import CHAIN_MUL, BlockHasher, TokenIdError, fmix64, fmix64_inverse
from kvcore.namespace import namespace_seed

if TYPE_CHECKING:
    from adapters.base import StoreNameSink

__all__ = ["MalformedEventError", "WorkerNormalizer"]

_MASK = (1 << 64) - 1

_Held = tuple[int, int | None, int | None]


class MalformedEventError(ValueError):
    """A native event that decodes but cannot be normalized (wrong token count, ...)."""


class WorkerNormalizer:
    """Normalizes one worker's (one DP rank's) native block operations."""

    __slots__ = (
        "_block_counters",
        "_blocks",
        "_hasher",
        "_metrics",
        "_pending",
        "_stored_blocks",
        "block_size",
        "model_id",
        "store_names",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        model_id: str,
        hasher: BlockHasher,
        metrics: AdapterMetrics | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.model_id = model_id
        self._hasher = hasher
        self.block_size = hasher.block_size
        # tier → engine hash → (canonical hash, canonical parent or None, chain state or None);
        # the chain state (fmix64⁻¹ of the canonical hash) is kept where it was computed
        # anyway (the last block of a batched chain): a child stored later continues from it
        # instead of inverting the hash.
        self._blocks: dict[Tier, dict[int, _Held]] = {t: {} for t in Tier}
        self._metrics = metrics
        self._block_counters: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self._stored_blocks = 0  # counted apart from _pending: the hot path
        self.store_names: StoreNameSink | None = None  # hears each chain stored

    # --- native operations --------------------------------------------------------------

    def stored(
        self,
        engine_hashes: Sequence[int],
        engine_parent: int | None,
        token_ids: list[int],
        tier: Tier,
        out: list[KVEvent],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        locals_: Sequence[int] | None = None,
    ) -> None:
        """Blocks ``engine_hashes`` (a chain under ``engine_parent``) now hold ``token_ids``.

        ``token_ids`` has ``block_size`` ids per block; the last block may be partial and is
        then skipped. ``locals_`` are the blocks' precomputed locals (``short_chain_locals``),
        if any.
        """
        n = len(engine_hashes)
        if n == 0:
            return
        bs = self.block_size
        count = len(token_ids)
        if not (n - 1) * bs < count <= n * bs:
            raise MalformedEventError(f"{n} blocks of {bs} tokens cannot hold {count} token ids")
        full = count // bs
        parent: int | None = None
        parent_state: int | None = None
        if engine_parent is not None:
            entry = self._entry(engine_parent, tier)
            if entry is None:
                self.count("orphaned", n)
                return
            parent, _, parent_state = entry
        if full < n:
            self.count("skipped", n - full)
            if full == 0:
                return
        seed = namespace_seed(self.model_id, lora_name, cache_salt)
        tokens = token_ids if full * bs == count else token_ids[: full * bs]
        if locals_ is not None and len(locals_) >= full:
            if parent is None:
                state = seed
            else:
                state = fmix64_inverse(parent) if parent_state is None else parent_state
            if full == 1:
                # One block (the common batched case): the recurrence, inline.
                state = (state * CHAIN_MUL + locals_[0]) & _MASK
                hashes = [fmix64(state)]
            else:
                hashes, state = chain_states(
                    locals_ if len(locals_) == full else locals_[:full], state
                )
        else:
            state = None
            try:
                hashes = self._hasher.hash_tokens(tokens, seed, parent)
            except TokenIdError as exc:
                raise MalformedEventError(str(exc)) from exc
        held = self._blocks[tier]
        if full == 1:
            held[engine_hashes[0]] = (hashes[0], parent, state)
        else:
            prev = parent
            for engine_hash, canonical in zip(engine_hashes, hashes, strict=False):
                held[engine_hash] = (canonical, prev, None)
                prev = canonical
            if state is not None:
                held[engine_hashes[full - 1]] = (hashes[-1], hashes[-2], state)
        self._stored_blocks += full
        if self.store_names is not None:
            self.store_names(engine_hashes[:full], hashes, parent)
        out.append(BlockStored(self.worker_id, UNSTAMPED, UNSTAMPED, tier, hashes, parent, tokens))

    def short_chain_locals(
        self, chains: Sequence[tuple[int, Sequence[int]]]
    ) -> list[list[int] | None] | None:
        """Locals of the full blocks of several short stored chains, in one vectorized pass.

        ``chains`` holds (number of blocks, token ids) per stored event of one batch; the
        result lines up with it (None for a chain whose token count fits no block count),
        or is None when batching does not pay or a token id is invalid (the per-event path
        then reports it).
        """
        bs = self.block_size
        flat: list[int] = []
        spans: list[tuple[int, int] | None] = []  # [start, end) in blocks of flat
        start = 0
        for n, tokens in chains:
            count = len(tokens)
            if count == n * bs:
                flat += tokens
                end = start + n
            elif (n - 1) * bs < count < n * bs:
                full = count // bs
                flat += tokens[: full * bs]
                end = start + full
            else:
                spans.append(None)
                continue
            spans.append((start, end))
            start = end
        if len(spans) < 2 or not flat:
            return None
        try:
            locs = block_locals(self._hasher, flat)
        except TokenIdError:
            return None
        return [None if sp is None else locs[sp[0] : sp[1]] for sp in spans]

    def removed(self, engine_hashes: Sequence[int], tier: Tier | None, out: list[KVEvent]) -> None:
        """Blocks ``engine_hashes`` left ``tier`` (None: whichever tier holds each one);
        unknown ones are counted and ignored."""
        if tier is not None:
            held = self._blocks[tier]
            gone = [e[0] for h in engine_hashes if (e := held.pop(h, None)) is not None]
            self._emit_removed(tier, gone, len(engine_hashes), out)
            return
        by_tier: dict[Tier, list[int]] = {}
        for h in engine_hashes:
            for t, held in self._blocks.items():
                entry = held.pop(h, None)
                if entry is not None:
                    by_tier.setdefault(t, []).append(entry[0])
                    break
        found = sum(len(v) for v in by_tier.values())
        if found < len(engine_hashes):
            self.count("unknown_removed", len(engine_hashes) - found)
        for t, gone in by_tier.items():
            self._emit_removed(t, gone, len(gone), out)

    def _emit_removed(self, tier: Tier, gone: list[int], asked: int, out: list[KVEvent]) -> None:
        if asked > len(gone):
            self.count("unknown_removed", asked - len(gone))
        if gone:
            self.count("removed", len(gone))
            out.append(BlockRemoved(self.worker_id, UNSTAMPED, UNSTAMPED, tier, gone))

    def moved(self, engine_hash: int, src: Tier, dst: Tier, out: list[KVEvent]) -> None:
        """One block moved from ``src`` to ``dst`` (TensorRT-LLM's offload/onboard update)."""
        entry = self._blocks[src].pop(engine_hash, None)
        if entry is None:
            self.count("unknown_removed", 1)
            return
        canonical, parent = entry[0], entry[1]
        out.append(BlockRemoved(self.worker_id, UNSTAMPED, UNSTAMPED, src, [canonical]))
        self._blocks[dst][engine_hash] = entry
        out.append(BlockStored(self.worker_id, UNSTAMPED, UNSTAMPED, dst, [canonical], parent))

    def cleared(self, tier: Tier | None, out: list[KVEvent]) -> None:
        """Every block in ``tier`` is gone (None: in every tier)."""
        out.extend(
            AllBlocksCleared(self.worker_id, UNSTAMPED, UNSTAMPED, t)
            for t in self._clear_tiers(tier)
        )

    def resync(self, out: list[KVEvent]) -> None:
        """What the engine holds is unknown (it restarted, or events were lost for good):
        forget everything and say so with ``AllBlocksCleared`` (the GPU tier always), so
        every consumer drops the worker's old blocks; what follows rebuilds them."""
        self.cleared(None, out)

    # --- state --------------------------------------------------------------------------

    def holds(self, engine_hash: int, tier: Tier) -> bool:
        """Whether the engine block ``engine_hash`` is held in ``tier``."""
        return engine_hash in self._blocks[tier]

    def num_blocks(self, tier: Tier | None = None) -> int:
        if tier is not None:
            return len(self._blocks[tier])
        return sum(len(held) for held in self._blocks.values())

    # --- helpers ------------------------------------------------------------------------

    def _entry(self, engine_hash: int, tier: Tier) -> _Held | None:
        """What is held for an engine block, looked up in ``tier`` first."""
        entry = self._blocks[tier].get(engine_hash)
        if entry is None:
            for other in Tier:
                if other is not tier and (entry := self._blocks[other].get(engine_hash)):
                    break
        return entry

    def _clear_tiers(self, tier: Tier | None) -> list[Tier]:
        """Empty ``tier`` (or all); the tiers to announce: GPU always, others if they held any."""
        tiers = [tier] if tier is not None else list(Tier)
        announce = []
        for t in tiers:
            if t is Tier.GPU or self._blocks[t] or tier is not None:
                announce.append(t)
            self._blocks[t].clear()
        return announce

    def count(self, outcome: str, n: int) -> None:
        """Count ``n`` blocks under ``outcome`` (one the adapter decided: ``filtered``,
        ``skipped``); added to the Prometheus counter at the next ``flush_metrics``."""
        pending = self._pending
        pending[outcome] = pending.get(outcome, 0) + n

    def flush_metrics(self) -> None:
        """Add the block counts gathered since the last flush to the Prometheus counters
        (once per native batch: per-event ``inc`` calls cost more than the bookkeeping)."""
        pending, self._pending = self._pending, {}
        if self._stored_blocks:
            pending["stored"] = pending.get("stored", 0) + self._stored_blocks
            self._stored_blocks = 0
        if self._metrics is None:
            return
        for outcome, n in pending.items():
            child = self._block_counters.get(outcome)
            if child is None:
                m = self._metrics
                child = m.blocks.labels(m.engine, self.worker_id, outcome)
                self._block_counters[outcome] = child
            child.inc(n)
