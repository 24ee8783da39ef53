"""Canonical events → vLLM's KV events, hashed as the consumer expects (no sockets).

What the sidecar republishes in vLLM's wire format (``sidecar/zmq_publisher.py``) so that
any router that reads vLLM's events (vllm-router's ``kv_aware``, llm-d's indexer, Dynamo)
indexes an SGLang or TensorRT-LLM fleet too. One ``VllmEventWriter`` per worker:

* **Stored** chains are rehashed from their token ids with vLLM's scheme (``--hash``:
  ``sha256_cbor`` or ``xxhash_cbor``, seeded like ``PYTHONHASHSEED``; ``block_hash``), each
  block's digest chaining on its parent's, kept per (tier, canonical hash) so a later chain
  and a removal find it. ``canonical`` passes our own 64-bit hashes through unchanged (for
  consumers that key by the events' token ids, as vllm-router does, and ignore the hashes).
* **Left out** (counted, never guessed): a chain without token ids (a relay may strip them),
  one whose parent this writer never published (``orphaned``), and a first block hashed
  under another namespace than the model's own (a LoRA adapter or a tenant salt: vLLM puts
  those in ``extra_keys``, which canonical events do not carry, and a consumer hashing the
  bare tokens would wrongly match them).
* **Removed** blocks go out under the hashes they were stored with; unknown ones are
  dropped. **Cleared** becomes the removal of every block published in that tier: vLLM's
  ``AllBlocksCleared`` has no medium and would wipe the other tiers too.

``medium`` names the tier with vLLM's strings (``MEDIUMS``).
"""

from __future__ import annotations

from collections import Counter

from adapters.vllm.block_hash import VllmBlockHasher, VllmHashAlgo, external_hash
from adapters.vllm.wire import VlBlockRemoved, VlBlockStored, VlEvent
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import namespace_seed

__all__ = ["CANONICAL", "MEDIUMS", "VllmEventWriter"]

CANONICAL = "canonical"  # the --hash value that keeps our own hashes
MEDIUMS = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK", Tier.REMOTE: "EXTERNAL"}


class VllmEventWriter:
    """One worker's canonical events as vLLM events; ``skipped`` counts blocks left out,
    by reason."""

    def __init__(
        self, model_id: str, block_size: int, hash_algo: str, seed: str = "0"
    ) -> None:
        self.block_size = block_size
        self._hasher = (
            None if hash_algo == CANONICAL
            else VllmBlockHasher(VllmHashAlgo(hash_algo), block_size, seed)
        )
        self._ours = BlockHasher(block_size)
        self._root_seed = namespace_seed(model_id)
        # tier → canonical hash → the digest it was published under (canonical: the hash)
        self._held: dict[Tier, dict[int, bytes | int]] = {t: {} for t in Tier}
        self.skipped: Counter[str] = Counter()
        self.blocks_published = 0

    def translate(self, event: KVEvent) -> list[VlEvent]:
        """The vLLM events that say what ``event`` says (none when it is left out)."""
        if isinstance(event, BlockStored):
            stored = self._stored(event)
            return [] if stored is None else [stored]
        if isinstance(event, BlockRemoved):
            return self._removed(event.tier, event.block_hashes)
        if isinstance(event, AllBlocksCleared):
            return self._removed(event.tier, list(self._held[event.tier]))
        raise TypeError(f"not a KV event: {type(event).__name__}")

    def _stored(self, event: BlockStored) -> VlBlockStored | None:
        n = len(event.block_hashes)
        tokens = event.token_ids
        if tokens is None or len(tokens) != n * self.block_size:
            self.skipped["no_tokens"] += n
            return None
        held = self._held[event.tier]
        parent: bytes | int | None = None
        if event.parent_hash is not None:
            parent = held.get(event.parent_hash)
            if parent is None:
                self.skipped["orphaned"] += n
                return None
        elif self._ours.chain(None, tokens[: self.block_size], self._root_seed) != (
            event.block_hashes[0]
        ):
            self.skipped["namespaced"] += n
            return None
        if self._hasher is None:
            digests: list[bytes | int] = list(event.block_hashes)
            externals = list(event.block_hashes)
            parent_ext = parent if isinstance(parent, int) else None
        else:
            assert parent is None or isinstance(parent, bytes)
            digests = list(self._hasher.chain(parent, tokens))
            externals = [external_hash(d) for d in digests if isinstance(d, bytes)]
            parent_ext = None if parent is None else external_hash(parent)
        for ours, digest in zip(event.block_hashes, digests, strict=True):
            held[ours] = digest
        self.blocks_published += n
        return VlBlockStored(
            block_hashes=externals,
            parent_block_hash=parent_ext,
            token_ids=list(tokens),
            block_size=self.block_size,
            medium=MEDIUMS[event.tier],
        )

    def _removed(self, tier: Tier, hashes: list[int]) -> list[VlEvent]:
        held = self._held[tier]
        gone = []
        for h in hashes:
            digest = held.pop(h, None)
            if digest is not None:
                gone.append(digest if isinstance(digest, int) else external_hash(digest))
        if not gone:
            return []
        return [VlBlockRemoved(block_hashes=gone, medium=MEDIUMS[tier])]
