"""The gateway's API end to end: a real gateway (in process), fake engines behind it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.support import gateway_http as h

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def stack(module_spawn):  # type: ignore[no-untyped-def]
    """Two fake engines behind one round-robin gateway."""
    engines = [module_spawn.engine(), module_spawn.engine()]
    gateway = module_spawn.gateway(engines, "--router-mode", "round-robin")
    return gateway, engines


async def test_non_streaming_chat_and_completion(stack) -> None:  # type: ignore[no-untyped-def]
    """Non-streaming replies come back whole, with worker, cached-blocks and request-id headers."""
    gateway, engines = stack
    for path, body in (
        ("/v1/chat/completions", h.chat(max_tokens=3)),
        ("/v1/completions", {"model": "fake-model", "prompt": "hello", "max_tokens": 3}),
    ):
        status, headers, raw = await h.post(gateway.url, path, body)
        assert status == 200, raw
        reply = orjson.loads(raw)
        assert reply["usage"]["completion_tokens"] == 3
        assert headers["x-kvsidecar-worker"] in {e.url for e in engines}
        assert headers["x-kvsidecar-cached-blocks"] == "0"
        assert headers["x-request-id"].startswith("kvs-"), (path, headers)


async def test_streaming_with_usage(stack) -> None:  # type: ignore[no-untyped-def]
    """SSE events pass through in order, with the usage chunk and [DONE]."""
    gateway, _ = stack
    body = h.chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
    status, headers, raw = await h.post(gateway.url, "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = h.sse_events(raw)
    assert events[-1] == b"[DONE]" and len(events) == 7
    tokens = [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:5]]
    assert tokens == [f"t{i} " for i in range(5)]
    assert orjson.loads(events[5])["usage"]["completion_tokens"] == 5
    assert "x-kvsidecar-worker" in headers and "x-request-id" in headers


async def test_large_reply_passes_through_intact(stack) -> None:  # type: ignore[no-untyped-def]
    """A 3 MB reply arrives byte for byte (relayed across many socket reads)."""
    gateway, _ = stack
    status, _, raw = await h.post(
        gateway.url, "/v1/chat/completions", h.chat(max_tokens=2, fake_pad_bytes=3 << 20)
    )
    assert status == 200
    content = orjson.loads(raw)["choices"][0]["message"]["content"]
    assert content == "t0 t1 " + "x" * (3 << 20)


async def test_request_id_is_forwarded_and_echoed(stack) -> None:  # type: ignore[no-untyped-def]
    """A client's x-request-id reaches the engine and comes back; its credential does not."""
    gateway, engines = stack
    rid = "client-chosen-id-42"
    status, headers, _ = await h.post(
        gateway.url,
        "/v1/chat/completions",
        h.chat(),
        headers={"x-request-id": rid, "authorization": "Bearer k"},
    )
    assert status == 200 and headers["x-request-id"] == rid
    seen = []
    for engine in engines:
        seen += (await h.get_json(engine.url, "/_stats"))["seen"]
    match = [s for s in seen if s["request_id"] == rid]
    assert len(match) == 1 and match[0]["authorization"] is None


async def test_authorization_is_forwarded_when_asked(spawn) -> None:  # type: ignore[no-untyped-def]
    """With --forward-authorization the client's Authorization reaches the engine."""
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--forward-authorization")
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat(),
                                headers={"x-request-id": "auth-1", "authorization": "Bearer k"})
    assert status == 200
    (seen,) = [s for s in (await h.get_json(engine.url, "/_stats"))["seen"]
               if s["request_id"] == "auth-1"]
    assert seen["authorization"] == "Bearer k"


async def test_generated_request_ids_reach_the_engine(stack) -> None:  # type: ignore[no-untyped-def]
    """Without a client id the gateway makes one, sends it upstream and returns it."""
    gateway, engines = stack
    _, headers, _ = await h.post(
        gateway.url, "/v1/completions", {"model": "fake-model", "prompt": "x"}
    )
    rid = headers["x-request-id"]
    seen = []
    for engine in engines:
        seen += (await h.get_json(engine.url, "/_stats"))["seen"]
    assert any(s["request_id"] == rid for s in seen)


MALFORMED = [
    ("/v1/chat/completions", b"{oops", 400, "not valid JSON"),
    ("/v1/chat/completions", b'"a string"', 400, "must be a JSON object"),
    ("/v1/chat/completions", orjson.dumps({"messages": []}), 400, "'model' is required"),
    ("/v1/chat/completions", orjson.dumps({"model": "fake-model"}), 400, "'messages'"),
    ("/v1/chat/completions", orjson.dumps(h.chat(temperature=9)), 400, "'temperature'"),
    ("/v1/chat/completions", orjson.dumps(h.chat(max_tokens=-1)), 400, "'max_tokens'"),
    (
        "/v1/chat/completions",
        orjson.dumps(h.chat(stream_options={"include_usage": True})),
        400,
        "only allowed",
    ),
    ("/v1/completions", orjson.dumps({"model": "fake-model", "prompt": 5}), 400, "'prompt'"),
    ("/v1/completions", orjson.dumps({"model": "gpt-9", "prompt": "x"}), 404, "does not exist"),
]


@pytest.mark.parametrize(("path", "raw", "status", "fragment"), MALFORMED)
async def test_malformed_requests(stack, path: str, raw: bytes, status: int, fragment: str) -> None:  # type: ignore[no-untyped-def]
    """Every malformed request kind gets its OpenAI-shaped 4xx; the engines never see it."""
    gateway, _ = stack
    code, headers, body = await h.post(gateway.url, path, raw)
    assert code == status
    error = orjson.loads(body)["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert "x-request-id" in headers
    if status == 404:
        assert error["code"] == "model_not_found"


async def test_wrong_method_and_unknown_path(stack) -> None:  # type: ignore[no-untyped-def]
    """GET on a POST endpoint is 405; an unknown path is 404, both OpenAI-shaped with a
    code naming the reason."""
    gateway, _ = stack
    status, body = await h.get(gateway.url, "/v1/chat/completions")
    error = orjson.loads(body)["error"]
    assert status == 405 and "takes POST" in error["message"]
    assert error["code"] == "method_not_allowed"
    status, body = await h.get(gateway.url, "/v1/nothing")
    error = orjson.loads(body)["error"]
    assert status == 404 and error["code"] == "unknown_endpoint"
    assert error["type"] == "invalid_request_error"


async def test_malformed_http_keeps_others_alive(stack) -> None:  # type: ignore[no-untyped-def]
    """Garbage on one connection gets a 400 there and nothing else is disturbed."""
    import asyncio

    gateway, _ = stack
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    reply = await reader.read()
    writer.close()
    assert reply.startswith(b"HTTP/1.1 400")
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 200


async def test_models_health_workers_metrics(stack) -> None:  # type: ignore[no-untyped-def]
    """/v1/models, /health, /v1/workers and /metrics describe the gateway."""
    gateway, engines = stack
    models = await h.get_json(gateway.url, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    health = await h.get_json(gateway.url, "/health")
    assert health == {"status": "ok", "healthy_workers": 2}
    workers = await h.get_json(gateway.url, "/v1/workers")
    assert [w["worker_id"] for w in workers["workers"]] == [e.url for e in engines]
    assert all(w["healthy"] and w["in_flight"] == 0 for w in workers["workers"])
    assert workers["scorer"]["learned"] == ["overlap_weight", "prefill_load_scale"]
    status, text = await h.get(gateway.url, "/metrics")
    assert status == 200
    assert (
        b'kvsidecar_gateway_responses_total{endpoint="/v1/chat/completions",status="200"}' in text
    )
    assert b"kvsidecar_gateway_ttft_seconds_bucket" in text
    assert b"kvsidecar_gateway_actual_cached_tokens_total" in text


async def test_pipelined_requests_answered_in_order(stack) -> None:  # type: ignore[no-untyped-def]
    """Two requests written back to back on one connection get two replies, in order."""
    import asyncio

    gateway, _ = stack

    def request(rid: str) -> bytes:
        body = orjson.dumps(h.chat(max_tokens=2))
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\nx-request-id: "
            + rid.encode()
            + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
            + body
        )

    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(request("first") + request("second"))
    data = b""
    async with asyncio.timeout(10):
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            data += await reader.read(65536)
    writer.close()
    assert data.index(b"x-request-id: first") < data.index(b"x-request-id: second")


def test_kvsidecar_gateway_subcommand() -> None:
    """`kvsidecar gateway --help` reaches the gateway's flags."""
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "gateway", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "--router-mode" in out.stdout and "--worker" in out.stdout


async def test_expect_100_continue(stack) -> None:  # type: ignore[no-untyped-def]
    """A client that sends Expect: 100-continue gets the go-ahead before sending its body."""
    import asyncio

    gateway, _ = stack
    body = orjson.dumps(h.chat("x" * 2000))
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    async with asyncio.timeout(5):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
    writer.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "fake-model", "input": "hi", "tools": []}),
        ("/v1/messages", {"model": "fake-model", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"model": "fake-model", "input": ["a", "b"]}),
        ("/v1/tokenize", {"model": "fake-model", "prompt": "hello"}),
    ],
)
async def test_other_openai_routes_reach_a_worker(stack, path: str, body: dict) -> None:  # type: ignore[no-untyped-def]
    """Responses, Anthropic messages, embeddings and tokenize go to a worker as they came,
    and its answer comes back with the gateway's headers."""
    gateway, _ = stack
    status, headers, raw = await h.post(gateway.url, path, body)
    assert status == 200 and headers["x-kvsidecar-worker"]
    assert orjson.loads(raw) == {"object": "echo", "path": path, "body": body}
    status, _, raw = await h.post(gateway.url, path, {**body, "model": "other"})
    error = orjson.loads(raw)
    if path == "/v1/messages":  # Anthropic's route, Anthropic's error shape
        assert status == 404 and error["type"] == "error"
        assert error["error"]["type"] == "not_found_error"
    else:
        assert status == 404 and error["error"]["code"] == "model_not_found"


async def test_a_lora_adapter_of_a_served_model_is_served(stack) -> None:  # type: ignore[no-untyped-def]
    """'<model>:<adapter>' is accepted for a served model and reaches the engine as written;
    an adapter of a model not served is still a 404."""
    gateway, engines = stack
    body = {**h.chat(), "model": "fake-model:adapter-1"}
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", body,
                                headers={"x-request-id": "lora-1"})
    assert status == 200
    seen = []
    for engine in engines:
        seen += (await h.get_json(engine.url, "/_stats"))["seen"]
    (match,) = [s for s in seen if s["request_id"] == "lora-1"]
    assert match["body"]["model"] == "fake-model:adapter-1"
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions",
                                {**h.chat(), "model": "other:adapter-1"})
    assert status == 404
