"""``kvsidecar indexer`` as a real process: publishers registered through the RFC's /register
(real reference engines' SGLang-format streams, and a vLLM-format publisher on loopback), then
/query answers checked against what each publisher really stored."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcore import BlockHasher, namespace_seed
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from kvsidecar.stack_argv import indexer_argv, sidecar_argv
from routing.indexer.rolling_hashes import rolling_hashes
from tests.integration.sidecar.test_zmq_republish import (
    PUBLISH,
    replay,
    stored_blocks,
    vllm_hashes,
)
from tests.integration.stack.test_stack import EVENTS
from tests.support.polling import eventually
from tests.support.processes import ProcessGroup
from tests.unit.adapters.fake_engines import FakeVllmPublisher
from tests.unit.routing.indexer.test_requests import (
    RFC_QUERY_BY_HASH,
    RFC_REGISTER,
    RFC_UNREGISTER,
)

pytestmark = pytest.mark.slow
BLOCK = 16
PROMPT_A = [(5 * i + 1) % 900 + 10 for i in range(70)]  # 4 full blocks
PROMPT_B = [(11 * i + 2) % 900 + 10 for i in range(120)]  # 7 full blocks
PROMPT_C = [(13 * i + 5) % 900 + 10 for i in range(100)]  # 6 full blocks


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Two reference engines (simulated compute) publishing SGLang-format KV events: what
    each said once ready (its URL and KV event endpoints)."""
    spec = StackSpec(engines=(EngineSpec(replicas=2, sidecars=False),), gateways=(),
                     events_config=EVENTS)
    with LocalStack(spec, tmp_path_factory.mktemp("engines")) as stack:
        yield [part.ready for part in stack.engines]


@pytest.fixture
async def indexer(tmp_path: Path) -> AsyncIterator[str]:
    with ProcessGroup[ManagedProcess]() as group:
        proc = group.add(ManagedProcess.start("indexer", indexer_argv("--idle-probe-s", "0.2"),
                                              workdir=tmp_path))
        proc.wait_ready(30)
        yield proc.url


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def registration(engine: dict[str, Any], instance: str, rank: int, **extra: Any) -> dict[str, Any]:
    return {"endpoint": engine["kv_events_endpoint"],
            "replay_endpoint": engine["kv_replay_endpoint"], "type": "SGLang",
            "modelname": "tiny", "instance_id": instance, "block_size": BLOCK, "dp_rank": rank,
            **extra}


async def generate(session: aiohttp.ClientSession, engine: dict[str, Any],
                   tokens: list[int]) -> None:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}
    async with session.post(f"{engine['url']}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def connected(session: aiohttp.ClientSession, url: str, count: int) -> None:
    async def check() -> bool:
        async with session.get(f"{url}/workers") as resp:
            workers = await resp.json()
        assert sum(w["connected"] for w in workers) >= count, workers
        return True
    await eventually(check, f"{count} publishers connected", 15, 0.05)


async def test_dp_ranks_and_tenants_of_real_engines(engines, indexer, session) -> None:  # type: ignore[no-untyped-def]
    """Two engines registered as DP ranks 0 and 1 of one instance: each prompt counts on the
    rank that ran it; the same publisher under another tenant answers only that tenant."""
    for rank, engine in enumerate(engines):
        status, body = await post(session, f"{indexer}/register",
                                  registration(engine, "node-a", rank))
        assert (status, body) == (200, {"status": "registered successfully",
                                        "instance_id": "node-a"})
    status, _ = await post(session, f"{indexer}/register",
                           registration(engines[0], "node-b", 0, tenant_id="acme"))
    assert status == 200
    await connected(session, indexer, 3)
    await generate(session, engines[0], PROMPT_A)
    await generate(session, engines[1], PROMPT_B)
    query = {"model": "tiny", "block_size": BLOCK, "tenant_id": "default"}

    async def answered(tokens: list[int], rank: str) -> dict[str, Any]:
        status, body = await post(session, f"{indexer}/query", {**query, "token_ids": tokens})
        assert status == 200 and body["default"]["node-a"]["DP"][rank] > 0, body
        return dict(body)

    a = await eventually(lambda: answered(PROMPT_A, "0"), "prompt A indexed", 15, 0.05)
    assert a == {"default": {"node-a": {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0,
                                        "REMOTE": 0, "DP": {"0": 64, "1": 0}}}}
    b = await eventually(lambda: answered(PROMPT_B, "1"), "prompt B indexed", 15, 0.05)
    assert b["default"]["node-a"]["DP"] == {"0": 0, "1": 112}
    status, acme = await post(session, f"{indexer}/query",
                              {**query, "tenant_id": "acme", "token_ids": PROMPT_A})
    assert status == 200 and list(acme) == ["acme"]
    assert acme["acme"]["node-b"]["longest_matched"] == 64 and "node-a" not in acme["acme"]
    # Our canonical hashes of the prompt answer the same through /query_by_hash.
    hashes = BlockHasher(BLOCK).hash_tokens(PROMPT_A, namespace_seed("tiny"))
    status, by_hash = await post(session, f"{indexer}/query_by_hash", {
        **query, "seq_hashes": hashes, "hash_scheme": "kvsidecar-v1"})
    assert (status, by_hash) == (200, a)
    # And so do the RFC's XXH3-64 rolling hashes (seed 1337, the indexer's default), as the
    # RFC's example sends them: no hash_scheme.
    status, by_hash = await post(session, f"{indexer}/query_by_hash", {
        **query, "seq_hashes": rolling_hashes(PROMPT_A, BLOCK, 1337)})
    assert (status, by_hash) == (200, a)
    # Unregistering a rank takes its blocks out of the answers.
    status, body = await post(session, f"{indexer}/unregister", {
        "type": "SGLang", "modelname": "tiny", "instance_id": "node-a", "block_size": BLOCK,
        "dp_rank": 0})
    assert (status, body) == (200, {"status": "unregistered successfully",
                                    "removed_instances": ["node-a|default|0"]})
    status, body = await post(session, f"{indexer}/query", {**query, "token_ids": PROMPT_A})
    assert body["default"]["node-a"]["DP"] == {"1": 0}


async def test_an_indexer_started_after_a_sidecar_holds_blocks(engines, tmp_path, session) -> None:  # type: ignore[no-untyped-def]
    """An indexer started once a sidecar republishing in vLLM's format (--publish-zmq) holds
    a prompt's blocks rebuilds them from the republisher's replay buffer, token ids
    included: its /query_by_hash (XXH3) answers exactly as its /query."""
    with ProcessGroup[ManagedProcess]() as group:
        sidecar = group.add(ManagedProcess.start("sidecar", [
            "sidecar", *sidecar_argv(engines[0]["url"], "late-0", "agg", 0.0, PUBLISH)],
            workdir=tmp_path))
        published = sidecar.wait_ready(60)[0]["zmq_publish"]["late-0"]
        await generate(session, engines[0], PROMPT_C)
        hashes = set(vllm_hashes(PROMPT_C))

        async def republished() -> bool:
            blocks = stored_blocks([p for _, p in await replay(published["replay_endpoint"], 0)])
            assert hashes <= blocks.keys()
            return True

        await eventually(republished, "the prompt republished", 15, 0.05)
        proc = group.add(ManagedProcess.start("indexer", indexer_argv(), workdir=tmp_path))
        proc.wait_ready(30)
        status, _ = await post(session, f"{proc.url}/register", {
            "endpoint": published["endpoint"], "replay_endpoint": published["replay_endpoint"],
            "type": "vLLM", "modelname": "tiny", "instance_id": "late", "block_size": BLOCK,
            "dp_rank": 0})
        assert status == 200
        query = {"model": "tiny", "block_size": BLOCK, "token_ids": PROMPT_C}

        async def answered() -> dict[str, Any]:
            status, body = await post(session, f"{proc.url}/query", query)
            assert status == 200 and body["default"]["late"]["GPU"] == 96, body
            return dict(body)

        by_tokens = await eventually(answered, "the replayed blocks", 15, 0.05)
        status, body = await post(session, f"{proc.url}/query_by_hash", {
            "model": "tiny", "block_size": BLOCK,
            "seq_hashes": rolling_hashes(PROMPT_C, BLOCK, 1337)})
        assert (status, body) == (200, by_tokens)


async def test_tiers_and_registration_salt_from_a_vllm_publisher(indexer, session) -> None:  # type: ignore[no-untyped-def]
    """A vLLM publisher's GPU and CPU blocks count per medium; its registration's
    additionalsalt is the namespace a query's cache_salt names."""
    publisher = FakeVllmPublisher(BLOCK)
    try:
        status, _ = await post(session, f"{indexer}/register", {
            "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
            "type": "vLLM", "modelname": "tiny", "instance_id": "vllm-1", "block_size": BLOCK,
            "dp_rank": 0, "additionalsalt": "w8a8"})
        assert status == 200
        await connected(session, indexer, 1)
        tokens = list(range(100, 100 + 4 * BLOCK))
        await publisher.store([1, 2], None, tokens[: 2 * BLOCK])  # blocks 0-1 on the GPU
        await publisher.publish([{  # blocks 0-3 offloaded to CPU memory
            "type": "BlockStored", "block_hashes": [11, 12, 13, 14], "parent_block_hash": None,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "CPU",
            "lora_name": None}])
        query = {"model": "tiny", "block_size": BLOCK, "token_ids": tokens,
                 "cache_salt": "w8a8"}

        async def answered() -> dict[str, Any]:
            status, body = await post(session, f"{indexer}/query", query)
            assert status == 200 and body["default"]["vllm-1"]["CPU"] > 0, body
            return dict(body["default"]["vllm-1"])

        got = await eventually(answered, "the CPU blocks indexed", 15, 0.05)
        assert got == {"longest_matched": 64, "GPU": 32, "CPU": 64, "DISK": 0, "REMOTE": 0,
                       "DP": {"0": 64}}
        status, body = await post(session, f"{indexer}/query", {**query, "cache_salt": None})
        assert body["default"]["vllm-1"]["longest_matched"] == 0  # another namespace
        # The same prompt by its XXH3 rolling hashes: the same answer, in the same namespace.
        by_hash = {"model": "tiny", "block_size": BLOCK, "cache_salt": "w8a8",
                   "seq_hashes": rolling_hashes(tokens, BLOCK, 1337)}
        status, body = await post(session, f"{indexer}/query_by_hash", by_hash)
        assert (status, body["default"]["vllm-1"]) == (200, got)
        async with session.get(f"{indexer}/workers") as resp:
            (worker,) = await resp.json()
        assert worker["xxh3_blocks"] == 6, worker  # 2 on the GPU, 4 on the CPU
        status, body = await post(session, f"{indexer}/query_by_hash",
                                  {**by_hash, "cache_salt": None})
        assert body["default"]["vllm-1"]["longest_matched"] == 0
        # Evicted from the GPU, the blocks answer from the CPU alone; evicted there too, the
        # translation goes with them.
        await publisher.remove([1, 2])

        async def evicted(route: str, body: dict[str, Any]) -> dict[str, Any]:
            status, answer = await post(session, f"{indexer}{route}", body)
            assert status == 200 and answer["default"]["vllm-1"]["GPU"] == 0, answer
            return dict(answer["default"]["vllm-1"])

        gone_gpu = await eventually(lambda: evicted("/query", query), "GPU eviction", 15, 0.05)
        assert gone_gpu == {**got, "GPU": 0}
        assert await evicted("/query_by_hash", by_hash) == gone_gpu
        await publisher.publish([{"type": "BlockRemoved", "block_hashes": [11, 12, 13, 14],
                                  "medium": "CPU"}])

        async def forgotten() -> bool:
            assert await evicted("/query", query) == {**got, "longest_matched": 0, "GPU": 0,
                                                       "CPU": 0, "DP": {"0": 0}}
            return True

        await eventually(forgotten, "CPU eviction", 15, 0.05)
        assert await evicted("/query_by_hash", by_hash) == await evicted("/query", query)
        async with session.get(f"{indexer}/workers") as resp:
            (worker,) = await resp.json()
        assert worker["xxh3_blocks"] == 0, worker
    finally:
        await publisher.aclose()


async def test_rfc_examples_and_refusals(indexer, session) -> None:  # type: ignore[no-untyped-def]
    """The RFC's /register and /unregister examples round-trip with the RFC's answers; a
    second registration of the same key, unknown fields, types and models are refused in the
    gateway's error shape."""
    status, body = await post(session, f"{indexer}/register", RFC_REGISTER)
    assert (status, body) == (200, {"status": "registered successfully",
                                    "instance_id": "vllm-prefill-node1"})
    status, body = await post(session, f"{indexer}/register", RFC_REGISTER)
    assert (status, body["error"]["code"]) == (409, "already_registered")
    for bad, param in (({**RFC_REGISTER, "type": "Mooncake"}, "type"),
                       ({**RFC_REGISTER, "weight": 1}, "weight"),
                       ({**RFC_REGISTER, "dp_rank": 1, "endpoint": "1.1.1.1:5557"}, "endpoint")):
        status, body = await post(session, f"{indexer}/register", bad)
        assert (status, body["error"]["param"]) == (400, param), body
    query = {"model": "deepseek", "lora_name": "sql-adapter", "token_ids": [101, 15, 100, 55, 89],
             "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 128,
             "cache_salt": "w8a8"}  # the RFC's /query example, at the registered block size
    status, body = await post(session, f"{indexer}/query", query)
    assert (status, body) == (200, {"default": {"vllm-prefill-node1": {
        "longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "DP": {"0": 0}}}})
    status, body = await post(session, f"{indexer}/query", {**query, "block_size": 64})
    assert (status, body["error"]["param"]) == (400, "block_size")
    status, body = await post(session, f"{indexer}/query", {**query, "model": "other"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    # The RFC's /query_by_hash example: at the registered block size, an answer (nothing is
    # held); as written (block 64), the block size is refused; bad hashes and seeds are 400s.
    status, body = await post(session, f"{indexer}/query_by_hash",
                              {**RFC_QUERY_BY_HASH, "block_size": 128})
    assert (status, body) == (200, {"default": {"vllm-prefill-node1": {
        "longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "DP": {"0": 0}}}})
    for bad, param in (({}, "block_size"), ({"block_size": 128, "hash_seed": 7}, "hash_seed"),
                       ({"block_size": 128, "seq_hashes": [1, "2"]}, "seq_hashes"),
                       ({"block_size": 128, "hash_scheme": "sha256_cbor"}, "hash_scheme")):
        status, body = await post(session, f"{indexer}/query_by_hash",
                                  {**RFC_QUERY_BY_HASH, **bad})
        assert (status, body["error"]["param"]) == (400, param), body
    status, body = await post(session, f"{indexer}/register",
                              {**RFC_REGISTER, "dp_rank": 1, "hash_seed": 0})
    assert (status, body["error"]["param"]) == (400, "hash_seed")
    assert "--xxh3-seed" in body["error"]["message"]
    status, body = await post(session, f"{indexer}/unregister", {**RFC_UNREGISTER,
                                                                 "type": "SGLang"})
    assert (status, body["error"]["param"]) == (400, "type")
    status, body = await post(session, f"{indexer}/unregister", RFC_UNREGISTER)
    assert (status, body) == (200, {"status": "unregistered successfully",
                                    "removed_instances": ["vllm-prefill-node1|default|0"]})
    status, body = await post(session, f"{indexer}/unregister", RFC_UNREGISTER)
    assert (status, body["error"]["code"]) == (404, "instance_not_found")
    async with session.get(f"{indexer}/query") as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_a_publisher_of_other_blocks_is_reported_not_indexed(indexer, session) -> None:  # type: ignore[no-untyped-def]
    """A publisher whose blocks are not the registered block size stops being followed, and
    GET /workers says why."""
    publisher = FakeVllmPublisher(BLOCK)
    try:
        status, _ = await post(session, f"{indexer}/register", {
            "endpoint": publisher.endpoint, "type": "vllm", "modelname": "tiny",
            "instance_id": "vllm-2", "block_size": 2 * BLOCK, "dp_rank": 0})
        assert status == 200
        await connected(session, indexer, 1)
        stores = [1]
        await publisher.store(stores, None, list(range(BLOCK)))

        async def reported() -> str:
            async with session.get(f"{indexer}/workers") as resp:
                (worker,) = await resp.json()
            if not worker["error"]:
                # ZMQ drops what a PUB sends before the SUB's subscription reaches it (on a
                # busy machine, after "connected"): a live engine keeps storing, so does this
                stores[0] += 1
                await publisher.store(stores, None, list(range(BLOCK)))
            assert worker["error"] and not worker["connected"], worker
            return str(worker["error"])

        error = await eventually(reported, "the mismatch reported", 15, 0.05)
        assert f"blocks of {BLOCK}" in error
    finally:
        await publisher.aclose()
