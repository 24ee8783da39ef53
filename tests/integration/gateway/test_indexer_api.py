"""The KV indexer API (Mooncake RFC #1403) on a real gateway over real sidecars and engines:
the RFC's example requests, and answers checked against what the workers really hold."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvcore import BlockHasher, namespace_seed
from kvsidecar.local_stack import GatewaySpec
from routing.indexer.rolling_hashes import rolling_hashes
from tests.integration.stack.test_stack import Stack, start_stack, stop_stack
from tests.support.gateway import routable
from tests.support.polling import eventually
from tests.unit.routing.indexer.test_requests import (
    RFC_QUERY,
    RFC_QUERY_BY_HASH,
    RFC_REGISTER,
    RFC_UNREGISTER,
)

pytestmark = pytest.mark.slow
BLOCK = 16
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(100)]  # 6 full blocks and 4 tokens
FULL = len(PROMPT) // BLOCK * BLOCK
OURS = {"model": "tiny", "block_size": BLOCK, "token_ids": PROMPT}
ZERO = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "DP": {"0": 0}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("indexer"), gateway_flags=("--xxh3-seed", "1337"))
    yield s
    stop_stack(s)


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.fixture
async def served(stack: Stack, session: aiohttp.ClientSession) -> str:
    """The prompt run once through the gateway; the worker that served it."""
    await routable(session, stack.url, 2)
    async with session.post(f"{stack.url}/v1/completions",
                            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvsidecar-worker"]


async def test_query_answers_what_the_serving_worker_holds(stack, session, served) -> None:  # type: ignore[no-untyped-def]
    """After a prompt ran, /query gives its worker the prompt's full blocks on the GPU, the
    other worker nothing, under tenant 'default'."""
    async def answer() -> dict[str, Any]:
        status, body = await post(session, f"{stack.url}/query", OURS)
        assert status == 200, body
        assert body["default"][served]["GPU"] == FULL, body
        return dict(body["default"])

    instances = await eventually(answer, "the prompt's blocks in the index", 10, 0.05)
    assert instances.pop(served) == {**ZERO, "longest_matched": FULL, "GPU": FULL,
                                     "DP": {"0": FULL}}
    assert list(instances.values()) == [ZERO]


async def test_query_filters_and_separates_namespaces(stack, session, served) -> None:  # type: ignore[no-untyped-def]
    """instance_id picks one instance (an unknown one is a 404); another cache_salt or LoRA
    adapter is another namespace, holding nothing."""
    await eventually(lambda: _gpu(session, stack.url, OURS, served), "indexed", 10, 0.05)
    status, body = await post(session, f"{stack.url}/query",
                              {**OURS, "instance_id": served, "tenant_id": "default"})
    assert (status, list(body["default"])) == (200, [served])
    status, body = await post(session, f"{stack.url}/query", {**OURS, "instance_id": "nope"})
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        404, "instance_not_found", "instance_id")
    for other in ({"cache_salt": "w8a8"}, {"lora_name": "sql-adapter"}):
        status, body = await post(session, f"{stack.url}/query", {**OURS, **other})
        assert status == 200 and body["default"][served]["longest_matched"] == 0, other


async def test_query_by_hash_in_our_scheme(stack, session, served) -> None:  # type: ignore[no-untyped-def]
    """Our canonical hashes of the prompt, with hash_scheme kvsidecar-v1, answer as /query."""
    hashes = BlockHasher(BLOCK).hash_tokens(PROMPT, namespace_seed("tiny"))
    by_hash = {"model": "tiny", "block_size": BLOCK, "seq_hashes": hashes,
               "hash_scheme": "kvsidecar-v1"}
    await eventually(lambda: _gpu(session, stack.url, OURS, served), "indexed", 10, 0.05)
    status, body = await post(session, f"{stack.url}/query_by_hash", by_hash)
    assert status == 200 and body["default"][served]["longest_matched"] == FULL, body
    # longest_matched = block_size × matched hashes
    status, body = await post(session, f"{stack.url}/query_by_hash",
                              {**by_hash, "seq_hashes": hashes[:2]})
    assert body["default"][served]["GPU"] == 2 * BLOCK


async def test_query_by_hash_in_the_rfc_scheme_answers_as_query(stack, session, served) -> None:  # type: ignore[no-untyped-def]
    """The prompt's XXH3-64 rolling hashes (seed 1337, as the gateway was started), sent as
    the RFC's example sends them (no hash_scheme), answer exactly as /query with its token
    ids; a prefix of them counts block_size × its length; a hash_seed of another seed is a
    400 naming ours."""
    rfc = {"model": "tiny", "block_size": BLOCK, "tenant_id": "default",
           "seq_hashes": rolling_hashes(PROMPT, BLOCK, 1337)}
    await eventually(lambda: _gpu(session, stack.url, OURS, served), "indexed", 10, 0.05)
    _, by_tokens = await post(session, f"{stack.url}/query", OURS)
    status, body = await post(session, f"{stack.url}/query_by_hash", rfc)
    assert (status, body) == (200, by_tokens)
    status, body = await post(session, f"{stack.url}/query_by_hash",
                              {**rfc, "seq_hashes": rfc["seq_hashes"][:3], "hash_seed": 1337,
                               "instance_id": served})
    assert status == 200 and body["default"][served]["longest_matched"] == 3 * BLOCK, body
    status, body = await post(session, f"{stack.url}/query_by_hash",
                              {**rfc, "seq_hashes": rolling_hashes(PROMPT, BLOCK, 0)})
    assert body["default"][served]["longest_matched"] == 0  # another seed matches nothing
    status, body = await post(session, f"{stack.url}/query_by_hash", {**rfc, "hash_seed": 0})
    assert (status, body["error"]["param"]) == (400, "hash_seed")
    assert "1337" in body["error"]["message"]


async def test_a_gateway_started_after_the_sidecars_hold_blocks(stack, session, served) -> None:  # type: ignore[no-untyped-def]
    """A second gateway started once the prompt's blocks are held learns them from the
    sidecars' snapshots, token ids included: its /query_by_hash (XXH3) answers exactly as
    its /query, which gives the serving worker the prompt's full blocks."""
    await eventually(lambda: _gpu(session, stack.url, OURS, served), "indexed", 10, 0.05)
    (late,) = await asyncio.to_thread(stack.local.add_gateway, GatewaySpec(
        name="late", health_check_interval_s=0.5, wait_routable=False,
        args=("--xxh3-seed", "1337")))
    try:
        by_tokens = await eventually(lambda: _answer(session, late.url, OURS, served),
                                     "the late gateway's index", 15, 0.05)
        assert by_tokens["default"][served]["longest_matched"] == FULL
        status, body = await post(session, f"{late.url}/query_by_hash", {
            "model": "tiny", "block_size": BLOCK,
            "seq_hashes": rolling_hashes(PROMPT, BLOCK, 1337)})
        assert (status, body) == (200, by_tokens)
    finally:
        late.proc.stop()


async def _answer(session: aiohttp.ClientSession, url: str, query: Any,
                  worker: str) -> dict[str, Any]:
    status, body = await post(session, f"{url}/query", query)
    assert status == 200, body  # (a gateway just started may not list the worker yet)
    assert body["default"].get(worker, {}).get("GPU", 0) > 0, body
    return dict(body)


async def _gpu(session: aiohttp.ClientSession, url: str, query: Any, worker: str) -> bool:
    status, body = await post(session, f"{url}/query", query)
    assert status == 200 and body["default"][worker]["GPU"] > 0, body
    return True


@pytest.mark.parametrize(
    ("route", "body", "status", "code", "param"),
    [
        # The RFC's examples verbatim: another model, then our model with the RFC's block size.
        ("/query", RFC_QUERY, 404, "model_not_found", "model"),
        ("/query", {**RFC_QUERY, "model": "tiny"}, 400, None, "block_size"),
        ("/query", {**RFC_QUERY, "model": "tiny", "block_size": BLOCK, "tenant_id": "acme"},
         400, None, "tenant_id"),
        ("/query_by_hash", RFC_QUERY_BY_HASH, 404, "model_not_found", "model"),
        ("/query_by_hash", {**RFC_QUERY_BY_HASH, "model": "tiny", "block_size": BLOCK,
                            "hash_scheme": "sha256"}, 400, "unsupported_hash_scheme",
         "hash_scheme"),
        ("/query_by_hash", {**RFC_QUERY_BY_HASH, "seq_hashes": ["0x1f"]}, 400, None,
         "seq_hashes"),
        ("/register", RFC_REGISTER, 400, "registration_not_supported", None),
        ("/unregister", RFC_UNREGISTER, 400, "registration_not_supported", None),
        ("/register", {**RFC_REGISTER, "weight": 2}, 400, None, "weight"),
        ("/query", {**OURS, "lora_id": 1}, 400, None, "lora_id"),
    ],
)
async def test_refusals_in_the_gateway_error_shape(stack, session, route, body, status, code,  # type: ignore[no-untyped-def]
                                                   param) -> None:
    """The RFC's examples and bad bodies get the gateway's OpenAI-shaped errors, naming the
    field at fault."""
    got, answer = await post(session, f"{stack.url}{route}", body)
    assert got == status, answer
    error = answer["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_malformed_body_and_wrong_method(stack, session) -> None:  # type: ignore[no-untyped-def]
    """Not JSON is a 400; GET on a query route is a 405 that says POST."""
    async with session.post(f"{stack.url}/query", data=b"{not json") as resp:
        assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
    async with session.get(f"{stack.url}/query") as resp:
        assert resp.status == 405 and resp.headers["allow"] == "POST"
