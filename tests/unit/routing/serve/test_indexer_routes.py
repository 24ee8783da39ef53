"""The gateway's indexer routes: tenants, namespaces, instances and refusals, over a real
router and registry (the HTTP plumbing is tests/integration/gateway/test_indexer_api.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvcore import BlockHasher, namespace_seed
from kvcore.errors import OpenAIError
from kvcore.events import BlockStored, Tier
from routing.config import WorkerAddress
from routing.indexer.rolling_hashes import DEFAULT_XXH3_SEED, rolling_hashes
from routing.placement.kv_router import KvRouter
from routing.serve.auth import Tenant
from routing.serve.indexer_routes import IndexerRoutes
from routing.serve.rate_limit import RateLimits
from routing.workers.registry import Worker, WorkerKind, WorkerRegistry

BS = 4
HASHER = BlockHasher(BS)
TOKENS = list(range(10, 10 + 3 * BS))
ACME = Tenant("acme", "a1b2", RateLimits())


def routes(*, salt: str | None = None, xxh3_seed: int | None = None) -> IndexerRoutes:
    """Two sidecar workers, DP ranks 0 and 1 of 'node'; rank 1 holds TOKENS in ``salt``'s
    namespace."""
    router = KvRouter(block_size=BS)
    registry = WorkerRegistry(on_capacity=router.load.set_capacity)
    address = WorkerAddress.parse("http://127.0.0.1:9000")
    for rank in (0, 1):
        registry.add(Worker(f"node/dp{rank}", address, WorkerKind.SIDECAR, dp_rank=rank))
    r = IndexerRoutes(router, registry, HASHER, lambda: ["m"], xxh3_seed)
    blocks = HASHER.hash_tokens(TOKENS, namespace_seed("m", None, salt))
    router.apply(BlockStored("node/dp1", 1, 1, Tier.GPU, blocks, None, TOKENS))
    return r


def ask(r: IndexerRoutes, body: dict[str, Any], tenant: Tenant | None = None,
        path: bytes = b"/query") -> Any:
    return orjson.loads(r.answer(path, orjson.dumps(body), tenant))


QUERY = {"model": "m", "block_size": BS, "token_ids": TOKENS}


def test_ranks_of_one_sidecar_are_one_instance() -> None:
    """A sidecar's '<base>/dp<rank>' workers answer as one instance with a DP entry each."""
    assert ask(routes(), QUERY) == {"default": {"node": {
        "longest_matched": 12, "GPU": 12, "CPU": 0, "DISK": 0, "REMOTE": 0,
        "DP": {"0": 0, "1": 12}}}}


def test_a_tenant_queries_in_its_salted_namespace() -> None:
    """With API keys a query hashes under the caller's tenant salt (then its cache_salt), and
    answers under the tenant's name; without, the unsalted namespace is tenant 'default'."""
    r = routes(salt="a1b2")
    assert ask(r, QUERY, ACME)["acme"]["node"]["longest_matched"] == 12
    assert ask(r, {**QUERY, "tenant_id": "acme"}, ACME)["acme"]["node"]["GPU"] == 12
    assert ask(r, QUERY)["default"]["node"]["longest_matched"] == 0
    salted = routes(salt="a1b2:x")
    assert ask(salted, {**QUERY, "cache_salt": "x"}, ACME)["acme"]["node"]["GPU"] == 12


@pytest.mark.parametrize(
    ("body", "tenant", "status", "param"),
    [
        ({**QUERY, "tenant_id": "other"}, ACME, 403, "tenant_id"),  # another tenant's blocks
        ({**QUERY, "tenant_id": "acme"}, None, 400, "tenant_id"),  # no tenants here
        ({**QUERY, "model": "x"}, None, 404, "model"),
        ({**QUERY, "block_size": 16}, None, 400, "block_size"),
        ({**QUERY, "instance_id": "node/dp1"}, None, 404, "instance_id"),  # a rank, no instance
    ],
)
def test_refusals(body: dict[str, Any], tenant: Tenant | None, status: int, param: str) -> None:
    """Out-of-scope tenants, models, block sizes and instances are refused, naming the field."""
    with pytest.raises(OpenAIError) as info:
        ask(routes(), body, tenant)
    assert (info.value.status, info.value.param) == (status, param)


def test_registration_is_refused_after_it_parses() -> None:
    """/register is parsed (bad fields named) and then refused: workers join as sidecars."""
    reg = {"endpoint": "tcp://h:1", "type": "vLLM", "modelname": "m", "instance_id": "i",
           "block_size": BS, "dp_rank": 0}
    with pytest.raises(OpenAIError) as info:
        ask(routes(), reg, path=b"/register")
    assert info.value.code == "registration_not_supported" and "'i'" in info.value.message
    with pytest.raises(OpenAIError) as info:
        ask(routes(), {**reg, "dp_rank": "0"}, path=b"/register")
    assert info.value.param == "dp_rank"


def by_hash(tokens: list[int], seed: int = DEFAULT_XXH3_SEED, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "block_size": BS, "seq_hashes": rolling_hashes(tokens, BS, seed),
            **extra}


def test_query_by_hash_in_the_rfc_scheme_answers_as_query() -> None:
    """With --xxh3-seed, a prompt's XXH3 rolling hashes answer exactly as its token ids, in
    the caller's tenant namespace too; a prefix of them counts block_size × its length."""
    r = routes(xxh3_seed=DEFAULT_XXH3_SEED)
    assert ask(r, by_hash(TOKENS), path=b"/query_by_hash") == ask(r, QUERY)
    two = ask(r, by_hash(TOKENS[: 2 * BS], hash_seed=DEFAULT_XXH3_SEED), path=b"/query_by_hash")
    assert two["default"]["node"]["DP"] == {"0": 0, "1": 2 * BS}
    salted = routes(salt="a1b2", xxh3_seed=DEFAULT_XXH3_SEED)
    assert ask(salted, by_hash(TOKENS), ACME, b"/query_by_hash") == ask(salted, QUERY, ACME)
    assert ask(salted, by_hash(TOKENS), ACME, b"/query_by_hash")["acme"]["node"]["GPU"] == 12
    assert ask(salted, by_hash(TOKENS), path=b"/query_by_hash")["default"]["node"] == ask(
        salted, QUERY)["default"]["node"]  # unsalted: nothing, as /query


@pytest.mark.parametrize(
    ("seed", "body", "param", "says"),
    [
        (None, by_hash(TOKENS), "hash_scheme", "--xxh3-seed"),  # the gateway keeps none
        (DEFAULT_XXH3_SEED, by_hash(TOKENS, 7, hash_seed=7), "hash_seed", "seed 1337"),
    ],
)
def test_xxh3_refusals(seed: int | None, body: dict[str, Any], param: str, says: str) -> None:
    """Without --xxh3-seed, or with a query of another seed, /query_by_hash in the RFC's
    scheme is a 400 that says what to do."""
    with pytest.raises(OpenAIError) as info:
        ask(routes(xxh3_seed=seed), body, path=b"/query_by_hash")
    assert (info.value.status, info.value.param) == (400, param)
    assert says in info.value.message
