"""Placement end to end: spread, prefix affinity, tokenization as the engine does it."""

from __future__ import annotations

import random
from collections import Counter

import aiohttp
import orjson
import pytest
from tokenizers import Tokenizer

from tests.support import gateway_http as h
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # real processes, seconds a test

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "router",
    "cache",
    "prefix",
    "token",
    "engine",
    "replica",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def test_round_robin_spreads_evenly(spawn) -> None:  # type: ignore[no-untyped-def]
    """Round-robin alternates between the workers."""
    engines = [spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(engines, "--router-mode", "round-robin")
    served = Counter()
    for _ in range(10):
        _, headers, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
        served[headers["x-kvsidecar-worker"]] += 1
    assert served == {engines[0].url: 5, engines[1].url: 5}


async def test_least_loaded_avoids_the_busy_worker(spawn) -> None:  # type: ignore[no-untyped-def]
    """While one worker holds a stream, least-loaded sends new requests to the other."""
    engines = [spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(engines, "--router-mode", "least-loaded")
    # The stream hangs after its first event until we leave: busy however long we take.
    body = h.chat(stream=True, fake_hang=True)
    async with aiohttp.ClientSession() as session, session.post(
            gateway.url + "/v1/chat/completions", json=body) as held:
        assert held.status == 200
        assert (await held.content.readline()).startswith(b"data: ")
        ws = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
        assert sorted(w["in_flight"] for w in ws) == [0, 1]
        idle = next(w["worker_id"] for w in ws if w["in_flight"] == 0)
        served = Counter()
        for _ in range(4):
            _, headers, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
            served[headers["x-kvsidecar-worker"]] += 1
        assert served == {idle: 4}

    async def free() -> bool:  # the held stream ended with its client
        ws = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
        return all(w["in_flight"] == 0 for w in ws)

    await eventually(free, "the busy worker to be free", 10.0)


async def test_approx_keeps_a_repeated_prefix_on_one_worker(spawn, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """In approx mode, chats sharing a long system prompt land together, with cached blocks."""
    engines = [spawn.engine(), spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(
        engines,
        "--router-mode",
        "approx",
        "--model-path",
        str(tiny_model_dir),
        "--served-model-name",
        "fake-model",
    )
    rng = random.Random(5)
    groups = {g: _text(rng, 300) for g in range(3)}
    placed: dict[int, set[str]] = {g: set() for g in groups}
    cached = []
    for i in range(12):
        g = i % 3
        body = {
            "model": "fake-model",
            "messages": [
                {"role": "system", "content": groups[g]},
                {"role": "user", "content": f"question {i}: " + _text(rng, 10)},
            ],
        }
        status, headers, _ = await h.post(gateway.url, "/v1/chat/completions", body)
        assert status == 200
        placed[g].add(headers["x-kvsidecar-worker"])
        if i >= 3:
            cached.append(int(headers["x-kvsidecar-cached-blocks"]))
    assert all(len(workers) == 1 for workers in placed.values())
    assert min(cached) >= 10  # the shared system prompt is ~20 blocks of 16 tokens
    _, text = await h.get(gateway.url, "/metrics")
    metrics = dict(
        line.rsplit(" ", 1) for line in text.decode().splitlines() if not line.startswith("#")
    )
    predicted = float(metrics["kvsidecar_gateway_predicted_cached_tokens_total"])
    assert predicted >= 9 * 10 * 16
    assert float(metrics["kvsidecar_gateway_actual_cached_tokens_total"]) == 12 * 4  # fake usage
    per_worker = [
        v
        for k, v in metrics.items()
        if k.startswith("kvsidecar_gateway_worker_predicted_cached_tokens_total")
    ]
    assert sum(map(float, per_worker)) == predicted


async def test_completion_prompt_forwarded_as_token_ids(spawn, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """With --model-path a completion's text reaches the engine as the tokenizer's ids."""
    engine = spawn.engine()
    gateway = spawn.gateway(
        [engine],
        "--router-mode",
        "kv",
        "--model-path",
        str(tiny_model_dir),
        "--served-model-name",
        "fake-model",
    )
    text = "The quick brown fox jumps over the lazy dog. " * 4
    status, _, _ = await h.post(
        gateway.url,
        "/v1/completions",
        {"model": "fake-model", "prompt": text, "max_tokens": 2, "x_extra": "kept"},
    )
    assert status == 200
    seen = (await h.get_json(engine.url, "/_stats"))["seen"][-1]["body"]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert seen["prompt"] == tok.encode(text).ids and seen["x_extra"] == "kept"
    chat = h.chat("hello there")
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", chat)
    assert status == 200
    assert (await h.get_json(engine.url, "/_stats"))["seen"][-1]["body"] == chat


async def test_prompt_over_context_limit_is_400(spawn, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A prompt longer than config.json's max_position_embeddings (or the flag) is a 400."""
    engine = spawn.engine()
    gateway = spawn.gateway(
        [engine],
        "--model-path",
        str(tiny_model_dir),
        "--served-model-name",
        "fake-model",
        "--max-model-len",
        "128",
    )
    long_chat = h.chat("The quick brown fox jumps over the lazy dog. " * 40)
    status, _, body = await h.post(gateway.url, "/v1/chat/completions", long_chat)
    error = orjson.loads(body)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in error["message"]
    assert (await h.get_json(engine.url, "/_stats"))["requests"] == 0
    models = await h.get_json(gateway.url, "/v1/models")
    assert models["data"][0]["max_model_len"] == 128


async def test_a_long_prompt_is_tokenized_off_the_event_loop(spawn, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A prompt past 8,192 uncached characters is tokenized in a worker thread: the engine
    still gets exactly the tokenizer's ids; the same prompt again comes from the cache."""
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--router-mode", "kv", "--model-path",
                            str(tiny_model_dir), "--served-model-name", "fake-model",
                            "--max-model-len", "65536")
    text = "The quick brown fox jumps over the lazy dog. " * 200  # 9,000 characters
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for _ in range(2):
        status, _, body = await h.post(gateway.url, "/v1/completions",
                                       {"model": "fake-model", "prompt": text, "max_tokens": 2})
        assert status == 200, body
        seen = (await h.get_json(engine.url, "/_stats"))["seen"][-1]["body"]
        assert seen["prompt"] == tok.encode(text).ids
    _, metrics = await h.get(gateway.url, "/metrics")
    assert b"kvsidecar_gateway_tokenized_off_loop_total 1.0" in metrics
