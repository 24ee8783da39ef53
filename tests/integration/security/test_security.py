"""An operator's security through real processes: a reference engine with KV events, its
sidecar guarded by a control token (with a host-tier store), and a gateway serving HTTPS with
client API keys, tenants and rate limits (docs/security.md).

One stack serves the module; each test uses its own tenants or prompts, so none depends on
another's traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import ssl
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcore.control_token import CONTROL_TOKEN_HEADER
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from routing.serve.auth import tenant_salt
from sidecar.transfer.messages import (
    ExportOffer,
    ExportRequest,
    PeerInfo,
    ReleaseReply,
    Transport,
    decode,
    encode,
)
from tests.support.polling import eventually
from tests.support.tls import write_self_signed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
TOKEN = "ctl-9d2e61b4"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "slow": "sk-slow-3", "tok": "sk-tok-4"}
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]


def _key_file(path: Path) -> None:
    bob_digest = hashlib.sha256(KEYS["bob"].encode()).hexdigest()
    path.write_text(
        "# tenants of the security tests\n"
        f"{KEYS['alice']} alice\n"
        f"sha256:{bob_digest} bob          # stored hashed\n"
        f"{KEYS['slow']} slow rps=0.2       # one request, then one every 5 s\n"
        f"{KEYS['tok']} tok tps=0.5         # one request, then a long wait\n"
    )


@dataclass
class Stack:
    tmp: Path
    engine: ManagedProcess
    sidecar: ManagedProcess
    gateway: ManagedProcess
    cert: Path
    store_socket: Path
    local: LocalStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("security")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvs-sec-"))  # Unix socket paths stay short
    keys, token, cert, key = (tmp / n for n in ("keys", "token", "cert.pem", "key.pem"))
    _key_file(keys)
    token.write_text(TOKEN + "\n")
    write_self_signed(cert, key, "kvsidecar test gateway")
    store_socket = sock_dir / "store.sock"
    spec = StackSpec(
        engines=(EngineSpec(sidecar_args=(
            "--control-token-file", str(token), "--store-capacity-bytes", "1MiB",
            "--store-block-bytes", "4KiB", "--store-socket", str(store_socket))),),
        gateways=(GatewaySpec(health_check_interval_s=0.5, wait_routable=False, args=(
            "--api-key-file", str(keys), "--tls-cert", str(cert), "--tls-key", str(key),
            "--sidecar-token-file", str(token))),),
        model_path=str(MODEL), speedup=20.0, events_config=EVENTS,
    )
    with LocalStack(spec, tmp) as local:
        yield Stack(tmp, local.engines[0].proc, local.sidecars[0].proc, local.gateways[0].proc,
                    cert, store_socket, local)
    shutil.rmtree(sock_dir, ignore_errors=True)


def _tls(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    """A session that verifies the gateway's certificate and sends alice's key."""
    connector = aiohttp.TCPConnector(ssl=_tls(stack.cert))
    async with aiohttp.ClientSession(connector=connector, headers=_auth("alice")) as s:
        await _routable(s, stack.gateway.url)
        yield s


async def _routable(session: aiohttp.ClientSession, url: str) -> None:
    async def ready() -> bool:
        async with session.get(f"{url}/v1/workers") as resp:
            workers = (await resp.json())["workers"]
        assert any(w["routable"] for w in workers), workers
        return True

    await eventually(ready, "the sidecar's worker routable through the token", 30, 0.05)


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(words))


async def _chat(
    session: aiohttp.ClientSession, url: str, system: str, tenant: str = "alice",
    max_tokens: int = 2,
) -> tuple[int, dict[str, Any], int]:
    """(status, body, predicted cached blocks)."""
    body = {"model": "tiny", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "hi"}]}
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers=_auth(tenant)) as resp:
        predicted = int(resp.headers.get("x-kvsidecar-cached-blocks", "0"))
        data = await resp.json()
        return resp.status, data, predicted


def _cached_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _engine_prompt_tokens(session: aiohttp.ClientSession, engine_url: str) -> float:
    async with session.get(f"{engine_url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("sglang:prompt_tokens_total "):
                return float(line.split()[1])
    raise AssertionError("the engine reports no sglang:prompt_tokens_total")


# --- client keys ------------------------------------------------------------------------


async def test_a_missing_or_wrong_key_gets_401_and_reaches_no_engine(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    url = stack.gateway.url
    before = await _engine_prompt_tokens(client, stack.engine.url)
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    connector = aiohttp.TCPConnector(ssl=_tls(stack.cert))
    async with aiohttp.ClientSession(connector=connector) as anonymous:
        for headers in ({}, {"Authorization": "Bearer sk-alice-2"},
                        {"Authorization": f"Basic {KEYS['alice']}"}, {"x-api-key": "nope"}):
            for path in ("/v1/chat/completions", "/v1/completions"):
                async with anonymous.post(f"{url}{path}", json=body, headers=headers) as resp:
                    assert resp.status == 401
                    assert resp.headers["www-authenticate"] == "Bearer"
                    error = (await resp.json())["error"]
                    assert error["code"] == "invalid_api_key"
                    assert error["type"] == "authentication_error"
        for path in ("/v1/workers", "/v1/models"):  # operator data and the model list
            async with anonymous.get(f"{url}{path}") as resp:
                assert resp.status == 401
        async with anonymous.get(f"{url}/health") as resp:  # liveness stays open
            assert resp.status == 200
        async with anonymous.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            assert "kvsidecar_gateway_unauthorized_total" in await resp.text()
    assert await _engine_prompt_tokens(client, stack.engine.url) == before
    status, _, _ = await _chat(client, url, "a keyed request does reach the engine")
    assert status == 200
    assert await _engine_prompt_tokens(client, stack.engine.url) > before


async def test_a_hashed_key_in_x_api_key_is_accepted(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    body = {"model": "tiny", "max_tokens": 1, "prompt": "hello"}
    async with client.post(f"{stack.gateway.url}/v1/completions", json=body,
                           headers={"Authorization": "", "x-api-key": KEYS["bob"]}) as resp:
        assert resp.status == 401  # an empty Authorization is a wrong key, not a missing one
    connector = aiohttp.TCPConnector(ssl=_tls(stack.cert))
    async with aiohttp.ClientSession(connector=connector) as s, s.post(
        f"{stack.gateway.url}/v1/completions", json=body, headers={"x-api-key": KEYS["bob"]}
    ) as resp:
        assert resp.status == 200, await resp.text()


# --- tenants never share blocks ---------------------------------------------------------


async def test_two_tenants_with_identical_prompts_never_share_a_block(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    url = stack.gateway.url
    system = _text(11, 200)
    status, _, _ = await _chat(client, url, system, "alice")
    assert status == 200

    async def alice_hits() -> tuple[dict[str, Any], int] | None:
        status, body, predicted = await _chat(client, url, system, "alice")
        assert status == 200
        return (body, predicted) if predicted > 0 else None

    # The same tenant again: the index predicts its blocks, and the engine reuses them.
    again, predicted = await eventually(alice_hits, "alice's blocks in the gateway's index", 10)
    assert predicted > 0 and _cached_tokens(again) > 0

    async def cached_blocks() -> int:
        async with client.get(f"{url}/v1/workers") as resp:
            return int((await resp.json())["workers"][0]["cached_blocks"]["gpu"])

    held = await cached_blocks()
    # Another tenant, the identical prompt: nothing predicted, nothing reused by the engine.
    status, bob, predicted = await _chat(client, url, system, "bob")
    assert status == 200
    assert predicted == 0
    assert _cached_tokens(bob) == 0
    prompt_blocks = bob["usage"]["prompt_tokens"] // 16
    # ... and its blocks join the index beside alice's, none of them hers.
    await eventually(lambda: _more(cached_blocks, held + prompt_blocks),
                     "bob's own blocks in the gateway's index", 10)
    status, bob_again, predicted = await _chat(client, url, system, "bob")
    assert status == 200 and _cached_tokens(bob_again) > 0  # bob reuses his own


async def test_a_client_salt_cannot_reach_another_tenants_namespace(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    """Bob sends alice's own tenant salt as his cache_salt: his namespace is still his."""
    url = stack.gateway.url
    system = _text(23, 200)
    assert (await _chat(client, url, system, "alice"))[0] == 200

    async def alice_hits() -> bool:
        status, _, predicted = await _chat(client, url, system, "alice")
        return status == 200 and predicted > 0

    await eventually(alice_hits, "alice's blocks in the gateway's index", 10)
    body = {"model": "tiny", "max_tokens": 2, "cache_salt": tenant_salt(b"", "alice"),
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "hi"}]}
    async with client.post(f"{url}/v1/chat/completions", json=body,
                           headers=_auth("bob")) as resp:
        assert resp.status == 200
        assert resp.headers.get("x-kvsidecar-cached-blocks", "0") == "0"
        assert _cached_tokens(await resp.json()) == 0


async def _more(count: Any, at_least: int) -> bool:
    value = await count()
    assert value >= at_least, f"{value} cached blocks, expected >= {at_least}"
    return True


# --- rate limits ------------------------------------------------------------------------


async def test_a_tenant_over_its_request_rate_gets_429_and_others_are_served(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    url = stack.gateway.url
    results = await asyncio.gather(
        *(_chat(client, url, f"slow tenant {i}", "slow") for i in range(3))
    )
    statuses = sorted(r[0] for r in results)
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    refused = next(r[1] for r in results if r[0] == 429)
    assert refused["error"]["code"] == "rate_limit_exceeded"
    assert "requests per second" in refused["error"]["message"]
    body = {"model": "tiny", "max_tokens": 1, "prompt": "over the limit"}
    async with client.post(f"{url}/v1/completions", json=body, headers=_auth("slow")) as resp:
        assert resp.status == 429
        assert int(resp.headers["retry-after"]) >= 1
    for _ in range(3):  # alice, beside the refused tenant, is unaffected
        status, _, _ = await _chat(client, url, "alice is not limited")
        assert status == 200


async def test_a_tenant_over_its_token_rate_gets_429_with_retry_after(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    url = stack.gateway.url
    status, body, _ = await _chat(client, url, _text(3, 40), "tok", max_tokens=8)
    assert status == 200
    cost = body["usage"]["prompt_tokens"] + 8
    body = {"model": "tiny", "max_tokens": 1, "prompt": "one more"}
    async with client.post(f"{url}/v1/completions", json=body, headers=_auth("tok")) as resp:
        assert resp.status == 429
        error = (await resp.json())["error"]
        assert error["code"] == "rate_limit_exceeded" and "tokens per second" in error["message"]
        # The debt of the first request (all but the one-token burst) at 0.5 tokens/s.
        assert int(resp.headers["retry-after"]) >= (cost - 1) * 2
    status, _, _ = await _chat(client, url, "alice still served")
    assert status == 200


# --- TLS ----------------------------------------------------------------------------------


async def test_tls_serves_a_verifying_client_and_refuses_plain_http_cleanly(
    stack: Stack, client: aiohttp.ClientSession
) -> None:
    url = stack.gateway.url
    assert url.startswith("https://")
    body = {"model": "tiny", "max_tokens": 48, "stream": True,
            "messages": [{"role": "user", "content": _text(5, 30)}]}

    async def stream() -> list[bytes]:
        async with client.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return [line async for line in resp.content if line.startswith(b"data:")]

    streaming = asyncio.create_task(stream())
    plain = url.replace("https://", "http://")
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):  # a TLS port does not speak plain HTTP
            async with s.get(f"{plain}/health") as resp:
                await resp.read()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # unknown issuer
            async with s.get(f"{url}/health") as resp:
                await resp.read()
    lines = await streaming
    assert lines[-1].strip() == b"data: [DONE]"  # the stream in flight did not notice
    status, _, _ = await _chat(client, url, "after a plain-HTTP attempt")
    assert status == 200


# --- the sidecar's control token ----------------------------------------------------------


async def test_the_sidecars_control_routes_refuse_a_caller_without_its_token(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    url = stack.sidecar.url
    generate = {"request_id": "s1", "model": "tiny", "kind": "completion",
                "prompt_token_ids": list(range(10, 42)), "max_tokens": 2}
    for method, path, payload in (
        ("GET", "/v1/kv-events", None),
        ("GET", "/v1/load", None),
        ("GET", "/v1/workers", None),
        ("GET", "/v1/blocks/info", None),
        ("POST", "/v1/kvsidecar/generate", generate),
        ("POST", "/v1/kvsidecar/pd/generate", generate),
    ):
        for headers in ({}, {CONTROL_TOKEN_HEADER: "wrong"}, {"Authorization": f"Bearer {TOKEN}"}):
            async with session.request(method, f"{url}{path}", headers=headers,
                                       json=payload) as r:
                assert r.status == 401, (path, headers)
                assert (await r.json())["error"]["code"] == "invalid_control_token"
    async with session.get(f"{url}/health") as resp:
        assert resp.status == 200
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
    async with session.post(f"{url}/v1/kvsidecar/generate", json=generate,
                            headers={CONTROL_TOKEN_HEADER: TOKEN}) as resp:
        assert resp.status == 200, await resp.text()


async def test_an_unauthenticated_pull_from_the_block_export_is_refused(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """No token, no export lease; with the token, blocks put in the store are exported."""
    import numpy as np

    from kvcore import BlockHasher, Namespace
    from shm import BlockStoreClient

    url = stack.sidecar.url
    ok = {CONTROL_TOKEN_HEADER: TOKEN}
    async with session.get(f"{url}/v1/blocks/info", headers=ok) as resp:
        assert resp.status == 200
        info = decode(await resp.read(), PeerInfo)
    seed = Namespace("tiny").seed
    blocks = BlockHasher(16).hash_tokens(list(range(100, 164)), seed)
    with BlockStoreClient(str(stack.store_socket)) as store:  # same user: its 0600 socket
        store.put_many([(seed, b) for b in blocks],
                       [np.full(info.block_bytes, i, dtype=np.uint8) for i in range(len(blocks))],
                       parent_hashes=[None, *blocks[:-1]])
    request = encode(ExportRequest([(seed, b) for b in blocks], Transport.TCP,
                                   info.block_bytes, info.dtype, 5.0))
    for headers in ({}, {CONTROL_TOKEN_HEADER: TOKEN + "x"}):
        async with session.post(f"{url}/v1/blocks/export", data=request, headers=headers) as r:
            assert r.status == 401
    async with session.post(f"{url}/v1/blocks/export", data=request, headers=ok) as resp:
        assert resp.status == 200, await resp.text()
        offer = decode(await resp.read(), ExportOffer)
    assert len(offer.slots) == len(blocks)
    release = f"{url}/v1/blocks/exports/{offer.export_id}/release"
    async with session.post(release) as resp:
        assert resp.status == 401  # nor can a stranger release another's lease
    async with session.post(release, headers=ok) as resp:
        assert resp.status == 200
        assert decode(await resp.read(), ReleaseReply).export_id == offer.export_id


async def test_the_store_socket_and_segment_are_mode_0600(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    async with session.get(f"{stack.sidecar.url}/v1/blocks/info",
                           headers={CONTROL_TOKEN_HEADER: TOKEN}) as resp:
        info = decode(await resp.read(), PeerInfo)
    assert Path(info.socket) == stack.store_socket
    sock = os.stat(info.socket)
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
    segment = os.stat(Path("/dev/shm") / info.segment.lstrip("/"))
    assert stat.S_IMODE(segment.st_mode) == 0o600


async def test_a_gateway_without_the_token_reports_the_sidecar_unauthorized(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    gateway = stack.local.add_gateway(GatewaySpec(
        name="gateway-no-token", health_check_interval_s=10.0, wait_routable=False))[0].proc
    gateway.wait_ready(60)

    async def pending() -> list[dict[str, str]]:
        async with session.get(f"{gateway.url}/v1/workers") as resp:
            state = await resp.json()
        assert state["workers"] == []
        found = [p for p in state["pending_sidecars"] if "unauthorized" in p["reason"]]
        assert found, state
        return found

    found = await eventually(pending, "the sidecar reported unauthorized", 10)
    assert found[0]["url"] == stack.sidecar.url
    assert "--sidecar-token-file" in found[0]["reason"]
    assert "sidecar_unauthorized" in gateway.log_path.read_text()
    assert gateway.stop() == 0
