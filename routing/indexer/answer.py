"""What the indexer API answers a query with: per instance, the prefix it holds, in tokens.

An *instance* is the RFC's router-facing target; each of its DP ranks is one of our workers
(one ``PrefixIndex`` worker id). Per instance: ``longest_matched``, the leading blocks held by
one rank in any mix of tiers (``PrefixIndex.held_depth``); one count per medium, the leading
blocks held in that tier alone (the deepest rank's); ``DP``, each rank's ``longest_matched``.
All in tokens: ``block_size`` × blocks; a partial tail block is never counted.

Media are named as the RFC's example names them: ``GPU`` (our ``gpu`` tier), ``CPU``
(``host``), ``DISK`` (``disk``), and ``REMOTE`` (``remote``: the shared Redis-protocol tier,
a medium the RFC leaves room for: "future media can be added").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvcore import BlockHasher, namespace_seed
from kvcore.errors import OpenAIError
from kvcore.events import Tier
from routing.indexer.requests import UNSUPPORTED_HASH_SCHEME, HashScheme, IndexQuery
from routing.indexer.rolling_hashes import RollingHashMap
from routing.placement.prefix_index import PrefixIndex

__all__ = ["INSTANCE_NOT_FOUND", "MEDIUM_NAMES", "Rank", "answer", "answer_query"]

INSTANCE_NOT_FOUND = "instance_not_found"

# Each tier by the RFC's name for its medium: its own name, but ``host`` is the RFC's ``CPU``.
MEDIUM_NAMES = {tier: "CPU" if tier is Tier.HOST else tier.name for tier in Tier}


@dataclass(frozen=True, slots=True)
class Rank:
    """One DP rank of an instance: the worker whose blocks the index keeps."""

    dp_rank: int
    worker_id: str


def answer_query(
    index: PrefixIndex,
    block_hashes: Sequence[int],
    block_size: int,
    instances: Mapping[str, Sequence[Rank]],
) -> dict[str, dict[str, Any]]:
    """``{instance: {"longest_matched", "GPU", "CPU", "DISK", "REMOTE", "DP": {rank:
    tokens}}}`` for every instance of ``instances`` (those holding nothing answer zeros)."""
    by_tier = index.match_tiers(block_hashes) if block_hashes else {}
    out: dict[str, dict[str, Any]] = {}
    for instance, ranks in instances.items():
        media = dict.fromkeys(MEDIUM_NAMES.values(), 0)
        dp: dict[str, int] = {}
        for rank in ranks:
            for tier, name in MEDIUM_NAMES.items():
                depth = by_tier.get(tier, {}).get(rank.worker_id, 0)
                media[name] = max(media[name], depth * block_size)
            dp[str(rank.dp_rank)] = index.held_depth(rank.worker_id, block_hashes) * block_size
        out[instance] = {"longest_matched": max(dp.values(), default=0), **media, "DP": dp}
    return out


def answer(
    query: IndexQuery,
    index: PrefixIndex,
    hasher: BlockHasher,
    tenant_id: str,
    salt: str | None,
    instances: Mapping[str, Sequence[Rank]],
    rolling: RollingHashMap | None,
    no_rolling: str = "",
) -> bytes:
    """The JSON answer to a ``/query`` or ``/query_by_hash`` in scope: the tenant answered
    for, the namespace salt its blocks are hashed in, the instances it may see (narrowed to
    ``query.instance_id``: an unknown one is a 404). XXH3 ``seq_hashes`` are translated by
    ``rolling``; None: this index keeps none (``no_rolling`` says how to make it)."""
    if query.instance_id is not None:
        ranks = instances.get(query.instance_id)
        if ranks is None:
            raise OpenAIError(404, f"no instance {query.instance_id!r} here for tenant "
                              f"{tenant_id!r}; there are {sorted(instances)}",
                              param="instance_id", code=INSTANCE_NOT_FOUND)
        instances = {query.instance_id: ranks}
    seed = namespace_seed(query.model, query.lora_name, salt)
    if query.token_ids is not None:
        block_hashes = hasher.hash_tokens(query.token_ids, seed)
    elif query.hash_scheme is HashScheme.XXH3_64:
        block_hashes = _translated(query, rolling, seed, no_rolling)
    else:
        block_hashes = query.seq_hashes or []
    return orjson.dumps({tenant_id: answer_query(index, block_hashes, hasher.block_size,
                                                 instances)})


def _translated(query: IndexQuery, rolling: RollingHashMap | None, namespace: int,
                no_rolling: str) -> list[int]:
    """Our hashes of a query's XXH3 ``seq_hashes``, or a 400 when this index keeps no XXH3
    hashes or keeps them with another seed than the query's."""
    if rolling is None:
        raise OpenAIError(400, "POST /query_by_hash: this index keeps no XXH3-64 rolling "
                          f"hashes (the RFC's scheme){no_rolling}; send "
                          "'hash_scheme': 'kvsidecar-v1' with our canonical hashes, or POST "
                          "/query with the token_ids", param="hash_scheme",
                          code=UNSUPPORTED_HASH_SCHEME)
    if query.hash_seed is not None and query.hash_seed != rolling.seed:
        raise OpenAIError(400, f"POST /query_by_hash: 'hash_seed' is {query.hash_seed}, but "
                          f"this index hashes with XXH3 seed {rolling.seed}: hashes of "
                          "another seed match nothing here", param="hash_seed")
    return rolling.canonical(namespace, query.seq_hashes or [])
