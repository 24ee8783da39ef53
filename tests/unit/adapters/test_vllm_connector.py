"""The vLLM KV connector against a real block store, driven the way vLLM's scheduler and
model runner drive a connector (vLLM itself runs in tests/integration/vllm): its keys, the
byte layout of a stored block, loads and saves, and a store that is down or loses blocks."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from adapters.vllm import connector as vc
from adapters.vllm.connector_core import BlockRows, ConnectorSettings, block_keys, loadable_blocks
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from shm import BlockStoreClient
from tests.support.store_owner import OwnerThread, owner_config

BS = 4  # tokens per block
LAYERS, HEADS, DIM = 3, 2, 4
LAYER_BLOCK = (HEADS, BS, 2 * DIM)  # vLLM's CPU backend: [blocks, kv_heads, block, 2 × head]
BLOCK_BYTES = LAYERS * HEADS * BS * 2 * DIM * 2  # bfloat16
MODEL = "tiny"


@dataclass
class Request:
    """The engine-boundary fake: the members of vLLM's ``Request`` the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    lora_request: Any = None
    cache_salt: str | None = None


@dataclass
class Blocks:
    """vLLM's ``KVCacheBlocks``: one KV cache group's block ids."""

    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class Manager:
    """vLLM's ``KVCacheManager``, as far as the connector asks it: a request's blocks."""

    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.blocks[request_id],)


def vllm_config(socket: Path, policy: str = "recompute", **extra: Any) -> Any:
    transfer = SimpleNamespace(kv_load_failure_policy=policy,
                               kv_connector_extra_config={"socket": str(socket), **extra})
    return SimpleNamespace(kv_transfer_config=transfer,
                           model_config=SimpleNamespace(served_model_name=[MODEL], model="/m"),
                           cache_config=SimpleNamespace(block_size=BS))


@dataclass
class Engine:
    """One vLLM replica: its scheduler-side and worker-side connectors and KV cache, stepped
    as vLLM's scheduler and model runner step them."""

    scheduler: vc.KvSidecarConnector
    worker: vc.KvSidecarConnector
    layers: list[torch.Tensor]
    manager: Manager
    next_block: int = 0
    stepped: set[str] = field(default_factory=set)  # requests scheduled before

    def admit(self, request: Request, local_tokens: int = 0,
              chunk: int | None = None) -> tuple[int, list[int]]:
        """Schedule a new request (``local_tokens`` already on device), run its first step
        (of ``chunk`` tokens, else the whole prompt); the tokens matched and its blocks."""
        matched, load_async = self.scheduler.get_num_new_matched_tokens(request, local_tokens)
        assert load_async is False and matched is not None
        count = -(-len(request.prompt_token_ids) // BS)
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.manager.blocks[request.request_id] = blocks
        self.scheduler.update_state_after_alloc(request, Blocks(blocks), matched)
        computed = local_tokens + matched
        todo = len(request.prompt_token_ids) - computed
        self.step(request, computed, todo if chunk is None else min(chunk, todo))
        return matched, blocks

    def step(self, request: Request, computed: int, scheduled: int, seed: int = 0) -> set[int]:
        """One step: metadata to the worker, load, "forward" (fills the scheduled tokens'
        blocks), save; the device blocks the worker reports it failed to load. A request's
        first step lists it as new, later ones as cached, as vLLM's scheduler output does."""
        first_step = request.request_id not in self.stepped
        self.stepped.add(request.request_id)
        listed = ([request.request_id], [computed])
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id,
                                                num_computed_tokens=computed)]
            if first_step else [],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[] if first_step else listed[0],
                num_computed_tokens=[] if first_step else listed[1]),
            num_scheduled_tokens={request.request_id: scheduled})
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(out)))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        blocks = self.manager.blocks[request.request_id]
        first, last = computed // BS, -(-(computed + scheduled) // BS)
        compute(self, blocks[first:last], seed=hash(request.request_id) % 1000 + seed)
        self.worker.wait_for_save()
        failed = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return failed

    def block(self, block: int) -> list[torch.Tensor]:
        return [layer[block].clone() for layer in self.layers]

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def compute(engine: Engine, blocks: list[int], seed: int) -> None:
    """Stand-in for the forward pass: the blocks get KV values."""
    gen = torch.Generator().manual_seed(seed)
    for layer in engine.layers:
        layer[blocks] = torch.randn((len(blocks), *LAYER_BLOCK), generator=gen).bfloat16()


_ENGINES: list[Engine] = []


@pytest.fixture(autouse=True)
def close_engines() -> Iterator[None]:
    """Every engine's store connections close at the end of its test."""
    yield
    while _ENGINES:
        _ENGINES.pop().close()


@pytest.fixture
def store(sock_dir: Path) -> Iterator[Path]:
    config = owner_config(sock_dir, BLOCK_BYTES, dtype="bfloat16", layout="raw", num_slots=32)
    with OwnerThread(config):
        yield config.socket_path


def make_engine(socket: Path, blocks: int = 24, **extra: Any) -> Engine:
    config = vllm_config(socket, **extra)
    scheduler = vc.KvSidecarConnector(config, "SCHEDULER")
    worker = vc.KvSidecarConnector(config, "WORKER")
    manager = Manager()
    scheduler.bind_kv_cache_manager(manager)
    layers = [torch.zeros((blocks, *LAYER_BLOCK), dtype=torch.bfloat16) for _ in range(LAYERS)]
    engine = Engine(scheduler, worker, layers, manager)
    _ENGINES.append(engine)
    worker.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(layers)})
    return engine


def canonical(prompt: list[int], blocks: int, lora: str | None = None) -> list[tuple[int, int]]:
    seed = Namespace(MODEL, lora).seed
    return [(seed, h) for h in BlockHasher(BS).hash_tokens(prompt[: blocks * BS], seed)]


class TestKeys:
    def test_keys_are_the_gateways_canonical_hashes(self) -> None:
        """A prompt's keys: the namespace seed and the gateway's chained block hashes."""
        prompt = list(range(3 * BS + 1))
        seed = Namespace(MODEL).seed
        assert block_keys(BlockHasher(BS), prompt, seed, 3) == canonical(prompt, 3)
        assert block_keys(BlockHasher(BS), prompt, seed, 2) == canonical(prompt, 2)

    @pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 0), (BS, 0), (BS + 1, 1),
                                                    (3 * BS, 2), (3 * BS + 1, 3)])
    def test_a_load_leaves_the_last_prompt_token_to_compute(self, tokens: int,
                                                            blocks: int) -> None:
        """Never the block holding the prompt's last token: vLLM computes that one."""
        assert loadable_blocks(tokens, BS) == blocks

    def test_settings_come_from_the_extra_config(self) -> None:
        """The socket is required; the model id defaults to vLLM's served model name."""
        s = ConnectorSettings.from_extra_config({"socket": "/s.sock"}, "tiny", 32)
        assert (str(s.store.socket), s.model_id, s.block_size) == ("/s.sock", "tiny", 32)
        s = ConnectorSettings.from_extra_config({"socket": "/s", "model_id": "m"}, "tiny", 32)
        assert s.model_id == "m"
        with pytest.raises(ValueError, match='kvsidecar KV connector: extra_config needs "socket"'):
            ConnectorSettings.from_extra_config({}, "tiny", 32)
        with pytest.raises(ValueError, match=r"unknown extra_config keys \['sockt'\]"):
            ConnectorSettings.from_extra_config({"socket": "/s", "sockt": 1}, "tiny", 32)


class TestBlockRows:
    def test_a_stored_block_is_every_layers_block_in_order(self) -> None:
        """Layer after layer, each its block's bytes as the backend holds them."""
        layers = [torch.arange(6 * 8, dtype=torch.float32).reshape(6, 2, 4) + 100 * j
                  for j in range(3)]
        rows = BlockRows(layers, num_blocks=6)
        assert rows.block_bytes == 3 * 2 * 4 * 4 and rows.layer_bytes == [32, 32, 32]
        out = np.zeros(rows.block_bytes, dtype=np.uint8)
        rows.copy_out(4, out)
        expect = torch.cat([layer[4].reshape(-1) for layer in layers]).numpy().view(np.uint8)
        assert np.array_equal(out, expect)
        assert np.array_equal(rows.gather([4])[0], expect)  # the device path, same bytes

    def test_a_block_copied_in_is_the_block_copied_out(self) -> None:
        """Out of one cache, into another block of another: the same values per layer."""
        gen = torch.Generator().manual_seed(1)
        src = [torch.randn((5, *LAYER_BLOCK), generator=gen).bfloat16() for _ in range(LAYERS)]
        dst = [torch.zeros((5, *LAYER_BLOCK), dtype=torch.bfloat16) for _ in range(LAYERS)]
        a, b = BlockRows(src), BlockRows(dst)
        slot = np.zeros(a.block_bytes, dtype=np.uint8)
        a.copy_out(2, slot)
        b.copy_in(3, slot)
        b.scatter([1], torch.from_numpy(slot.reshape(1, -1)))  # the device path
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[3], s[2]) and torch.equal(d[1], s[2])
            assert not d[0].any()

    def test_strided_layers_in_one_buffer_are_read_in_place(self) -> None:
        """Layers that are views into one allocation (block-outermost) are rows in place."""
        raw = torch.zeros((4, 2, 8), dtype=torch.float32)  # [blocks, layers, per-layer]
        layers = [raw[:, j] for j in range(2)]
        rows = BlockRows(layers)
        rows.copy_in(1, np.arange(64, dtype=np.uint8))
        assert raw[1].numpy().view(np.uint8).tobytes() == bytes(range(64))

    def test_a_cache_that_is_not_block_major_is_refused(self) -> None:
        """A backend whose first axis is not the block (e.g. [2, blocks, ...]) is refused."""
        with pytest.raises(ValueError, match="block-major"):
            BlockRows([torch.zeros((2, 6, 4))], num_blocks=6)
        with pytest.raises(ValueError, match="not contiguous"):
            BlockRows([torch.zeros((6, 4, 2)).transpose(1, 2)])


class TestConnector:
    def test_a_prompt_computed_on_one_replica_loads_on_another(self, store: Path) -> None:
        """A saves the prompt's full blocks as its prefill computes them; B, which never saw
        the prompt, matches them (all but the last token's) and loads them exactly."""
        a, b = make_engine(store), make_engine(store)
        prompt = list(range(5 * BS + 2))
        matched, blocks_a = a.admit(Request("r1", prompt))
        assert matched == 0
        with BlockStoreClient(store) as plain:
            assert plain.contains_many(canonical(prompt, 5)) == [True] * 5
        matched, blocks_b = b.admit(Request("r2", prompt))
        assert matched == 5 * BS
        for i in range(5):
            assert all(torch.equal(x, y) for x, y in
                       zip(b.block(blocks_b[i]), a.block(blocks_a[i]), strict=True))
        assert b.worker.worker is not None
        assert b.worker.worker.link.counters.blocks_loaded == 5

    def test_chunked_prefill_saves_the_blocks_each_chunk_completes(self, store: Path) -> None:
        """A prompt prefilled in chunks: each step saves the blocks it completed, no more."""
        a = make_engine(store)
        prompt = list(range(4 * BS + 1))
        a.admit(Request("r1", prompt), chunk=BS + 2)
        with BlockStoreClient(store) as plain:
            assert plain.contains_many(canonical(prompt, 4)) == [True, False, False, False]
            a.step(Request("r1", prompt), BS + 2, len(prompt) - BS - 2)
            assert plain.contains_many(canonical(prompt, 4)) == [True] * 4

    def test_the_match_starts_after_the_device_prefix(self, store: Path) -> None:
        """Tokens vLLM holds on device are not reported again; loads fill the later blocks."""
        a, b = make_engine(store), make_engine(store)
        prompt = list(range(4 * BS + 2))
        _, blocks_a = a.admit(Request("r1", prompt))
        matched, blocks_b = b.admit(Request("r2", prompt), local_tokens=2 * BS)
        assert matched == 2 * BS
        assert torch.equal(b.layers[0][blocks_b[2:4]], a.layers[0][blocks_a[2:4]])

    def test_lora_and_salted_requests_are_apart(self, store: Path) -> None:
        """A LoRA adapter's or a cache salt's request never matches the base model's blocks."""
        a = make_engine(store)
        prompt = list(range(3 * BS + 1))
        a.admit(Request("r1", prompt))
        lora = SimpleNamespace(lora_name="sql")
        assert a.scheduler.get_num_new_matched_tokens(Request("r2", prompt, lora), 0) == (0, False)
        salted = Request("r3", prompt, cache_salt="tenant-a")
        assert a.scheduler.get_num_new_matched_tokens(salted, 0) == (0, False)
        assert a.scheduler.get_num_new_matched_tokens(Request("r4", prompt), 0) == (3 * BS, False)

    def test_a_store_that_is_down_turns_loads_into_misses(self, sock_dir: Path) -> None:
        """No store behind the socket: no match, saves do nothing, nothing raises."""
        a = make_engine(sock_dir / "absent.sock")
        prompt = list(range(3 * BS + 1))
        assert a.admit(Request("r1", prompt))[0] == 0
        assert a.admit(Request("r2", prompt))[0] == 0
        assert a.scheduler.scheduler is not None
        assert a.scheduler.scheduler.link.counters.calls_unavailable >= 2

    def test_blocks_gone_before_the_load_are_reported_for_recompute(self, store: Path) -> None:
        """Matched, then dropped from the store before the step loads them: vLLM is told
        which device blocks stayed empty, so it recomputes them."""
        a, b = make_engine(store), make_engine(store)
        prompt = list(range(3 * BS + 1))
        a.admit(Request("r1", prompt))
        request = Request("r2", prompt)
        matched, _ = b.scheduler.get_num_new_matched_tokens(request, 0)
        assert matched == 3 * BS
        b.manager.blocks["r2"] = blocks = [20, 21, 22, 23]
        b.scheduler.update_state_after_alloc(request, Blocks(blocks), matched)
        with BlockStoreClient(store) as plain:
            plain.remove_many(canonical(prompt, 3)[1:])
        assert b.step(request, matched, 1) == {21, 22}

    def test_tensor_parallel_ranks_are_refused(self, sock_dir: Path) -> None:
        """A rank's slice of a block is not the block: refused at start, with the reason."""
        config = vllm_config(sock_dir / "s.sock")
        config.parallel_config = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
        with pytest.raises(ValueError, match="without tensor or pipeline parallelism"):
            vc.KvSidecarConnector(config, "WORKER")

    def test_a_best_effort_cache_needs_no_delivery(self, store: Path) -> None:
        """A preempted request is not held for a save: a save cut short is a later miss."""
        assert make_engine(store).scheduler.requires_kv_delivery is False

    def test_a_store_of_another_geometry_is_refused_at_start(self, sock_dir: Path) -> None:
        """Blocks of the wrong size fail vLLM's start with the size to give the store."""
        config = owner_config(sock_dir, BLOCK_BYTES * 2, layout="raw", num_slots=4)
        with OwnerThread(config), pytest.raises(ValueError, match=f"--store-block-bytes "
                                                                  f"{BLOCK_BYTES}"):
            make_engine(config.socket_path)

    def test_the_fail_policy_is_refused(self, sock_dir: Path) -> None:
        """vLLM's default kv_load_failure_policy would fail a request on a dropped block."""
        with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
            vc.KvSidecarConnector(vllm_config(sock_dir / "s.sock", policy="fail"), "SCHEDULER")
