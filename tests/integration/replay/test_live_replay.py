"""Live replay against a fake OpenAI engine (the only fake: the engine boundary)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from replay.live import LiveConfig, replay_live
from replay.synthesis import TokenSynthesizer
from replay.traces import load_trace

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"
TRACE = SHARED / "conversation_trace.jsonl"
PAGE = 16
REFUSED_LENGTH = 13  # the fake refuses requests asking for exactly this many tokens


class FakeEngine:
    """Streams ``max_tokens`` chunks; cached tokens = longest page-aligned prefix seen before."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._seen: list[list[int]] = []

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for old in self._seen:
            n = 0
            for a, b in zip(old, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // PAGE * PAGE

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["max_tokens"] == REFUSED_LENGTH:
            return web.json_response({"error": {"message": "refused"}}, status=400)
        prompt = body["prompt"]
        cached = self.cached(prompt)
        self._seen.append(prompt)
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-kvsidecar-worker": "fake-0",
                "x-kvsidecar-cached-blocks": str(cached // PAGE),
            }
        )
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x"}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {
            "choices": [],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def fake(aiohttp_server: Any) -> tuple[FakeEngine, str]:
    engine = FakeEngine()
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/completions", engine.completions)
    server = await aiohttp_server(app)
    return engine, f"http://127.0.0.1:{server.port}"


async def test_each_request_is_sent_as_synthesized_tokens_and_recorded(
    fake: tuple[FakeEngine, str],
) -> None:
    """Token-id prompts, max_tokens and usage streaming go out; every field comes back."""
    engine, url = fake
    records = load_trace(TRACE, limit=12)
    synth = TokenSynthesizer(1024)
    results = await replay_live(records, synth, LiveConfig(url=url, speedup=1000.0))
    assert len(engine.bodies) == 12
    sent = {len(b["prompt"]): b for b in engine.bodies}
    for record, out in zip(records, results, strict=True):
        body = sent[record.input_tokens]
        assert body["prompt"] == synth.prompt(record.hash_ids, record.input_tokens)
        assert body["max_tokens"] == record.output_tokens
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert out.error is None
        assert out.worker == "fake-0"
        assert out.completion_tokens == record.output_tokens
        assert out.cached_tokens == out.predicted_cached_tokens
        assert out.ttft_s is not None and out.e2e_s is not None and out.e2e_s >= out.ttft_s
        assert out.itl_s is not None and len(out.itl_s) == record.output_tokens - 1
    # every conversation request starts with the shared block 0: later ones hit it
    assert all(out.cached_tokens and out.cached_tokens >= 512 for out in results[6:])


async def test_a_refused_request_records_its_error_and_the_rest_go_on(
    fake: tuple[FakeEngine, str],
) -> None:
    """An HTTP 400 is recorded with its body; the other requests succeed."""
    _, url = fake
    records = load_trace(TRACE, limit=6)
    records[2] = type(records[2])(2, records[2].arrival_s, 700, REFUSED_LENGTH, (777, 778))
    results = await replay_live(records, TokenSynthesizer(1024), LiveConfig(url=url, speedup=1e3))
    assert results[2].error is not None and "HTTP 400" in results[2].error
    assert "refused" in results[2].error
    assert [r.error for i, r in enumerate(results) if i != 2] == [None] * 5


async def test_an_unreachable_gateway_is_an_error_per_request() -> None:
    """Connection refused is recorded for each request; nothing raises."""
    records = load_trace(TRACE, limit=3)
    cfg = LiveConfig(url="http://127.0.0.1:9", speedup=1e3, connect_timeout_s=2.0)
    results = await replay_live(records, TokenSynthesizer(1024), cfg)
    assert all(r.error and "Connect" in r.error for r in results)


async def test_the_cli_writes_one_jsonl_record_per_request(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    """``kvsidecar replay TRACE --url`` writes the JSONL and prints the summary table."""
    _, url = fake
    output = tmp_path / "live.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvsidecar",
        "replay",
        str(TRACE),
        "--url",
        url,
        "--limit",
        "8",
        "--speedup",
        "1000",
        "--output",
        str(output),
        "--quiet",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[3],
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    assert "| live |" in stdout.decode()
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in lines] == list(range(8))
    assert all(r["error"] is None and r["worker"] == "fake-0" for r in lines)
    assert all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in lines)
