"""The whole stack through real processes: engines, sidecars and a KV-aware gateway."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from tests.support.gateway import routable
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv",
    }
)
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]


@dataclass
class Stack:
    engines: ManagedProcess
    sidecars: list[ManagedProcess]
    gateway: ManagedProcess
    engine_urls: list[str]
    local: LocalStack

    @property
    def url(self) -> str:
        return self.gateway.url


def start_stack(tmp: Path, replicas: int = 2, speedup: str = "5",
                gateway_flags: tuple[str, ...] = ()) -> Stack:
    spec = StackSpec(
        engines=(EngineSpec(replicas=replicas),),
        gateways=(GatewaySpec(health_check_interval_s=0.5, wait_routable=False,
                              args=("--dead-after-s", "1", "--seed", "1", *gateway_flags)),),
        model_path=str(MODEL), speedup=float(speedup), events_config=EVENTS,
    )
    local = LocalStack(spec, tmp).start()
    return Stack(local.engines[0].proc, [p.proc for p in local.sidecars], local.gateways[0].proc,
                 [e.url for e in local.engines], local)


def stop_stack(stack: Stack) -> None:
    stack.local.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the module's placement and request-surface tests: none of them needs a
    fresh one (each sends prompts of its own, and reads the gateway's counters as deltas)."""
    s = start_stack(tmp_path_factory.mktemp("stack"))
    yield s
    stop_stack(s)


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """A gateway counter's value (0 before its first increment)."""
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    return 0.0



def text(seed: int, words: int) -> str:
    return " ".join(
        WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97) for i in range(words)
    )


async def chat(
    session: aiohttp.ClientSession,
    url: str,
    system: str,
    user: str,
    max_tokens: int = 4,
    stream: bool = False,
) -> tuple[int, str, int, int]:
    """(status, worker, predicted cached blocks, engine-reported cached tokens)."""
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        worker = resp.headers.get("x-kvsidecar-worker", "")
        predicted = int(resp.headers.get("x-kvsidecar-cached-blocks", "0"))
        if not stream:
            data = await resp.json()
            cached = (
                (data.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
            )
            return resp.status, worker, predicted, cached
        lines = [line async for line in resp.content if line.startswith(b"data:")]
        assert lines[-1].strip() == b"data: [DONE]"
        usage = json.loads(lines[-2][5:])["usage"]
        return resp.status, worker, predicted, usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
class TestPlacement:
    async def test_shared_prefix_lands_where_it_is_cached(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """A request whose prefix is cached on one replica is placed there and hits."""
        await routable(session, stack.url, 2)
        system = text(1, 200)
        status, first, _, _ = await chat(session, stack.url, system, "hello")
        assert status == 200

        async def predicted_hit() -> tuple[int, str, int, int] | None:
            result = await chat(session, stack.url, system, "again")
            return result if result[2] > 0 else None

        # the stored events reach the gateway within a moment
        status, worker, predicted, cached = await eventually(
            predicted_hit, "the gateway to predict the cached prefix", timeout_s=10, interval_s=0
        )
        assert (status, worker) == (200, first)
        assert predicted > 0 and cached > 0

    async def test_equal_overlap_spreads_load(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """Unrelated prompts in flight together spread over both replicas."""
        await routable(session, stack.url, 2)
        results = await asyncio.gather(
            *(chat(session, stack.url, text(100 + i, 150), "hi", max_tokens=32) for i in range(8))
        )
        assert all(r[0] == 200 for r in results)
        assert len({r[1] for r in results}) == 2

    async def test_back_to_back_identical_prompts_do_not_scatter(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """Identical prompts sent together, before any event returns, share one replica."""
        await routable(session, stack.url, 2)
        system = text(7, 200)
        results = await asyncio.gather(
            *(chat(session, stack.url, system, "same") for _ in range(6))
        )
        assert all(r[0] == 200 for r in results)
        assert len({r[1] for r in results}) == 1

    async def test_200_concurrent_streams_complete(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """200 concurrent streams all finish with [DONE]; nothing is lost."""
        await routable(session, stack.url, 2)
        results = await asyncio.gather(
            *(
                chat(session, stack.url, text(i % 10, 30), f"q{i}", max_tokens=6, stream=True)
                for i in range(200)
            )
        )
        assert Counter(r[0] for r in results) == {200: 200}


@pytest.mark.slow
class TestRequestSurface:
    """Fields token ids cannot carry reach the engine's own OpenAI server through the sidecar;
    its answers and its refusals come back as it gave them."""

    async def test_a_field_the_engine_refuses_comes_back_as_its_error(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """logprobs reach the reference engine, which refuses them: the client reads why."""
        await routable(session, stack.url, 2)
        body = {"model": "tiny", "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400, error
            assert "logprobs are not supported by the reference engine" in error["message"]
            assert resp.headers["x-kvsidecar-worker"].startswith("replica-")

    @pytest.mark.parametrize("stream", [False, True])
    async def test_other_fields_are_answered_by_the_engines_openai_server(
        self, stack, session, stream: bool
    ) -> None:  # type: ignore[no-untyped-def]
        """A field the token path does not carry takes the engine's OpenAI route: its reply
        shape (reasoning_content, tool_calls) comes through, streamed or not, and the
        gateway counts it."""
        await routable(session, stack.url, 2)
        openai_requests = "kvsidecar_gateway_engine_openai_requests_total"
        before = await counter(session, stack.url, openai_requests)
        body = {"model": "tiny", "max_tokens": 4, "user": "client-7", "stream": stream,
                "messages": [{"role": "user", "content": "hello there"}]}
        async with session.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            if stream:
                events = [line async for line in resp.content if line.startswith(b"data:")]
                assert events[-1].strip() == b"data: [DONE]"
                chunks = [json.loads(e[5:]) for e in events[:-1]]
                assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
                finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
                assert "matched_stop" in finished[-1]["choices"][0]  # the engine's own chunk
            else:
                message = (await resp.json())["choices"][0]["message"]
                assert {"reasoning_content", "tool_calls"} <= set(message)
        assert await counter(session, stack.url, openai_requests) == before + 1

    async def test_other_routes_reach_the_engine_through_its_sidecar(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """/v1/tokenize is answered by the engine itself; a route the engine lacks comes back
        as the engine's own 404, in OpenAI's shape."""
        await routable(session, stack.url, 2)
        body = {"model": "tiny", "prompt": "hello there"}
        async with session.post(f"{stack.url}/v1/tokenize", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["count"] == len(answer["tokens"]) > 0
        async with session.post(f"{stack.url}/v1/embeddings",
                                json={"model": "tiny", "input": "x"}) as resp:
            assert resp.status == 404
            assert "error" in await resp.json()


@pytest.mark.slow
async def test_dead_sidecar_leaves_placement(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """A sidecar killed mid-stream cuts that stream only; later requests go to the other."""
    stack = start_stack(tmp_path, speedup="1")
    try:
        await routable(session, stack.url, 2)
        system = text(3, 100)
        _, victim, _, _ = await chat(session, stack.url, system, "warm")
        index = int(victim.rsplit("-", 1)[1])
        body = {
            "model": "tiny",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "long"},
            ],
        }
        async with session.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-kvsidecar-worker"] == victim
            await resp.content.readline()  # the stream has started
            stack.sidecars[index].kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                async for _ in resp.content:
                    pass
        survivors = set()
        for i in range(6):
            status, worker, _, _ = await chat(session, stack.url, text(50 + i, 40), "after")
            assert status == 200
            survivors.add(worker)
        assert victim not in survivors

        async def victim_gone() -> bool:
            async with session.get(f"{stack.url}/v1/workers") as r:
                state = {w["worker_id"]: w for w in (await r.json())["workers"]}
            dead = state[victim]
            assert not dead["routable"] and sum(dead["cached_blocks"].values()) == 0, dead
            return True

        await eventually(victim_gone, "the dead worker to leave placement", timeout_s=15,
                         interval_s=0.1)
    finally:
        stop_stack(stack)


@pytest.mark.slow
def test_kvsidecar_up_demo(tmp_path: Path) -> None:
    """`kvsidecar up --demo --exit-after-demo` starts the stack, prints the three policies
    side by side (hit rate, TTFT, throughput), stops."""
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar",
            "up",
            "--replicas",
            "2",
            "--port",
            "0",
            "--speedup",
            "5",
            "--demo",
            "--exit-after-demo",
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "kvsidecar is up: http://127.0.0.1:" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines()
            if line.startswith(("kv ", "round-robin", "least-loaded"))]
    assert [r[0] for r in rows] == ["kv", "round-robin", "least-loaded"]
    assert all(int(r[1]) == 128 and float(r[5]) > 0 for r in rows)  # requests, requests/s
    assert "more of them than one replica's KV cache (16,384 tokens) holds" in run.stdout


@pytest.mark.slow
async def test_sidecar_file_is_reread_on_change(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """Workers follow --sidecar-file: added and removed as the file changes."""
    stack = start_stack(tmp_path)
    listing = tmp_path / "sidecars.txt"
    listing.write_text(f"# the fleet\n{stack.sidecars[0].url}\n")
    gateway = stack.local.add_gateway(GatewaySpec(
        name="gateway-file", workers="none", health_check_interval_s=0.5, wait_routable=False,
        args=("--sidecar-file", str(listing))))[0].proc
    try:
        url = gateway.wait_ready(60)[0]["url"]

        async def worker_ids() -> set[str]:
            async with session.get(f"{url}/v1/workers") as resp:
                return {w["worker_id"] for w in (await resp.json())["workers"]}

        async def until(expected: set[str]) -> None:
            async def listed() -> bool:
                seen = await worker_ids()
                assert seen == expected, seen
                return True

            await eventually(listed, f"the workers {sorted(expected)}", timeout_s=20,
                             interval_s=0.05)

        await until({"replica-0"})
        await routable(session, url, 1)
        status, worker, _, _ = await chat(session, url, text(9, 20), "one")
        assert (status, worker) == (200, "replica-0")
        listing.write_text(f"{stack.sidecars[0].url}\n{stack.sidecars[1].url}\n")
        await until({"replica-0", "replica-1"})
        listing.write_text(f"{stack.sidecars[1].url}  # replica-0 retired\n")
        await until({"replica-1"})
        status, worker, _, _ = await chat(session, url, text(9, 20), "two")
        assert (status, worker) == (200, "replica-1")
    finally:
        gateway.stop()
        stop_stack(stack)
