"""The TensorRT-LLM KV cache connector against a real block store, driven the way TRT-LLM's
``KvCacheConnectorManager`` drives a connector (TRT-LLM itself cannot be installed here)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.storage.link import StoreMismatchError
from adapters.trtllm import connector as trt
from adapters.trtllm.connector_core import ConnectorMetadata, ConnectorSettings, rank_namespace
from kvcore.extras import MissingExtraError
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from shm import BlockStoreClient
from tests.support.store_owner import OwnerThread, owner_config

BS = 4  # tokens per block
LAYERS, HEADS, DIM = 2, 2, 4
BLOCK_SHAPE = (LAYERS, 2, HEADS * BS * DIM)  # TRT-LLM's pool: [blocks, layers, k|v, ...]
BLOCK_BYTES = LAYERS * 2 * HEADS * BS * DIM * 2  # float16


@dataclass
class Request:
    """The engine-boundary fake: the two ``LlmRequest`` members the connector reads."""

    request_id: int
    tokens: list[int]
    lora_task_id: int | None = None

    def get_tokens(self, beam: int) -> list[int]:
        return self.tokens


@dataclass
class LlmArgs:
    model: str = "org/model"
    kv_cache_config: Any = field(default_factory=lambda: type("K", (), {"tokens_per_block": BS}))
    enable_attention_dp: bool = False
    pipeline_parallel_size: int = 1


@dataclass
class Engine:
    """One engine replica's connector pair and KV pool, stepped like TRT-LLM's executor."""

    scheduler: trt.KvSidecarConnectorScheduler
    worker: trt.KvSidecarConnectorWorker
    kv: torch.Tensor
    next_block: int = 0

    def admit(self, request: Request, num_computed_tokens: int = 0) -> tuple[int, list[int]]:
        """Schedule a new request: match, allocate blocks for its prompt, load, forward."""
        matched, load_async = self.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens)
        assert load_async is False
        count = -(-len(request.tokens) // BS)
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.scheduler.update_state_after_alloc(request, blocks)
        self.step()
        return matched, blocks

    def step(self) -> list[int]:
        """One executor iteration: metadata to the workers, hooks around a forward pass."""
        self.worker.bind_connector_meta(pickle.loads(pickle.dumps(
            self.scheduler.build_connector_meta(None))))
        self.worker.start_load_kv(None)
        for layer in range(LAYERS):
            self.worker.wait_for_layer_load(layer, None)
            self.worker.save_kv_layer(layer, None)
        self.worker.wait_for_save(None)
        return []

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()

    def finish(self, request: Request, blocks: list[int]) -> list[int]:
        """The request ends: request_finished, a further step, then get_finished."""
        saving = self.scheduler.request_finished(request, blocks)
        assert saving is True
        announced = self.worker.get_finished([request.request_id], [])[0]
        self.step()
        return announced + self.worker.get_finished([], [])[0]


@pytest.fixture
def store(sock_dir: Path) -> Iterator[Path]:
    config = owner_config(sock_dir, BLOCK_BYTES, dtype="float16", layout="raw", num_slots=32)
    with OwnerThread(config):
        yield config.socket_path


_ENGINES: list[Engine] = []


@pytest.fixture(autouse=True)
def close_engines() -> Iterator[None]:
    """Every engine's store connections close at the end of its test."""
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def make_engine(socket: Path, *, rank: int = 0, world: int = 1, blocks: int = 16,
                args: LlmArgs | None = None) -> Engine:
    env = {"KVSIDECAR_STORE_SOCKET": str(socket), "KVSIDECAR_STORE_RETRY_S": "0"}
    llm_args = args or LlmArgs()
    scheduler = trt.KvSidecarConnectorScheduler(llm_args, environ=env)
    worker = trt.KvSidecarConnectorWorker(llm_args, environ=env, rank=rank, world_size=world)
    kv = torch.zeros((blocks, *BLOCK_SHAPE), dtype=torch.float16)
    engine = Engine(scheduler, worker, kv)
    _ENGINES.append(engine)
    worker.register_kv_caches(kv)
    return engine


def compute(engine: Engine, blocks: list[int], seed: int) -> None:
    """Stand-in for the forward pass: the blocks get KV values."""
    gen = torch.Generator().manual_seed(seed)
    engine.kv[blocks] = torch.randn((len(blocks), *BLOCK_SHAPE), generator=gen).half()


def test_a_finished_request_is_loaded_by_another_engine(store: Path) -> None:
    """Engine A saves its blocks on finish; engine B matches the prompt and loads them exactly."""
    a, b = make_engine(store), make_engine(store)
    prompt = list(range(5 * BS + 1))
    r1 = Request(1, prompt)
    matched, blocks_a = a.admit(r1)
    assert matched == 0
    compute(a, blocks_a, seed=1)
    r1.tokens = [*prompt, 900, 901, 902]  # generated tokens complete block 5
    assert a.finish(r1, blocks_a) == [1]
    matched, blocks_b = b.admit(Request(7, [*r1.tokens, 903]))
    assert matched == 6 * BS  # five prompt blocks and the generated one, not the last token
    assert torch.equal(b.kv[blocks_b[:6]], a.kv[blocks_a[:6]])
    assert not b.kv[blocks_b[6]].any()
    assert b.worker.core.link.counters.blocks_loaded == 6


def test_the_match_starts_after_the_device_prefix(store: Path) -> None:
    """Tokens already on device are not reported again; loads target the later blocks."""
    a, b = make_engine(store), make_engine(store)
    prompt = list(range(4 * BS + 2))
    _, blocks_a = a.admit(Request(1, prompt))
    compute(a, blocks_a, seed=2)
    a.finish(Request(1, prompt), blocks_a)
    matched, blocks_b = b.admit(Request(2, prompt), num_computed_tokens=2 * BS)
    assert matched == 2 * BS
    assert torch.equal(b.kv[blocks_b[2:4]], a.kv[blocks_a[2:4]])
    assert not b.kv[blocks_b[:2]].any()
    assert b.scheduler.get_num_new_matched_tokens(Request(3, prompt), BS + 1) == (0, False)


def test_a_prompt_of_whole_blocks_keeps_its_last_block_to_compute(store: Path) -> None:
    """The engine must compute the last prompt token, so its block is never matched."""
    a = make_engine(store)
    prompt = list(range(3 * BS))
    _, blocks = a.admit(Request(1, prompt))
    a.finish(Request(1, prompt), blocks)
    assert a.scheduler.get_num_new_matched_tokens(Request(2, prompt), 0) == (2 * BS, False)


def test_keys_are_canonical_and_lora_requests_are_apart(store: Path) -> None:
    """Saved blocks sit under the gateway's canonical hashes; a LoRA request does not match."""
    a = make_engine(store)
    prompt = list(range(2 * BS + 1))
    _, blocks = a.admit(Request(1, prompt))
    a.finish(Request(1, prompt), blocks)
    seed = Namespace("org/model").seed
    hashes = BlockHasher(BS).hash_tokens(prompt, seed)
    with BlockStoreClient(store) as plain:
        assert plain.contains_many([(seed, h) for h in hashes]) == [True, True]
    assert a.scheduler.get_num_new_matched_tokens(Request(2, prompt, lora_task_id=3), 0) == (
        0, False)


def test_ranks_keep_their_slices_apart(store: Path) -> None:
    """With two ranks each worker's slice of a block has its own store key."""
    r0, r1 = make_engine(store, rank=0, world=2), make_engine(store, rank=1, world=2)
    prompt = list(range(BS + 1))
    compute(r0, [0], seed=3)
    compute(r1, [0], seed=4)
    r0.scheduler.request_finished(Request(1, prompt), [0])
    meta = r0.scheduler.build_connector_meta(None)
    for engine in (r0, r1):  # TRT-LLM broadcasts the rank-0 metadata to every worker
        engine.worker.bind_connector_meta(meta)
        engine.worker.start_load_kv(None)
    seed = Namespace("org/model").seed
    (h,) = BlockHasher(BS).hash_tokens(prompt, seed)
    with BlockStoreClient(store) as plain:
        for engine, rank in ((r0, 0), (r1, 1)):
            got = plain.get((rank_namespace(seed, rank, 2), h)).view("uint16")
            assert torch.equal(torch.from_numpy(got.copy()).view(torch.float16),
                               engine.kv[0].reshape(-1))


def test_both_classes_declare_attention_dp_support() -> None:
    """TRT-LLM refuses a connector under attention DP unless both classes opt in."""
    assert trt.KvSidecarConnectorScheduler.supports_attention_dp is True
    assert trt.KvSidecarConnectorWorker.supports_attention_dp is True


def test_attention_dp_owners_share_one_pool(store: Path) -> None:
    """Under attention DP each rank owns whole blocks of its own requests: rank 1 loads what
    rank 0 saved, under the canonical keys, each owner planning only its own requests."""
    adp = LlmArgs(enable_attention_dp=True)
    r0 = make_engine(store, rank=0, world=2, args=adp)
    r1 = make_engine(store, rank=1, world=2, args=adp)
    prompt = list(range(3 * BS + 1))
    _, blocks0 = r0.admit(Request(1, prompt))
    compute(r0, blocks0, seed=5)
    assert r0.finish(Request(1, prompt), blocks0) == [1]
    seed = Namespace("org/model").seed
    hashes = BlockHasher(BS).hash_tokens(prompt, seed)
    with BlockStoreClient(store) as plain:
        assert plain.contains_many([(seed, h) for h in hashes]) == [True] * 3
    matched, blocks1 = r1.admit(Request(2, prompt))  # rank 1's own scheduler and worker
    assert matched == 3 * BS
    assert torch.equal(r1.kv[blocks1[:3]], r0.kv[blocks0[:3]])
    assert r0.worker.core.link.counters.blocks_loaded == 0


def test_attention_dp_with_pipeline_stages_is_refused(store: Path) -> None:
    """Owners of a slice of the layers cannot share whole blocks: a clear start-up error."""
    with pytest.raises(ValueError, match="pipeline_parallel_size is 2"):
        make_engine(store, rank=1, world=4,
                    args=LlmArgs(enable_attention_dp=True, pipeline_parallel_size=2))


def test_an_unreachable_store_never_stops_the_engine(sock_dir: Path) -> None:
    """No owner: nothing matches, finished requests are still released, failures are counted."""
    engine = make_engine(sock_dir / "absent.sock")
    prompt = list(range(3 * BS + 1))
    matched, blocks = engine.admit(Request(1, prompt))
    assert matched == 0
    assert engine.finish(Request(1, prompt), blocks) == [1]
    assert engine.worker.core.link.counters.calls_unavailable >= 1


def test_a_store_of_the_wrong_block_size_fails_registration(sock_dir: Path) -> None:
    """register_kv_caches refuses a store whose blocks are not this rank's KV blocks."""
    config = owner_config(sock_dir, BLOCK_BYTES * 2, dtype="float16", layout="raw")
    with OwnerThread(config), pytest.raises(StoreMismatchError, match=f"{BLOCK_BYTES}"):
        make_engine(config.socket_path)


def test_settings_come_from_llm_args_and_the_environment() -> None:
    """tokens_per_block from llm_args; socket and overrides from KVSIDECAR_ variables."""
    s = ConnectorSettings.from_llm_args(LlmArgs(), {"KVSIDECAR_STORE_SOCKET": "/s",
                                                    "KVSIDECAR_MODEL_ID": "served"})
    assert (s.socket, s.model_id, s.tokens_per_block) == (Path("/s"), "served", BS)
    with pytest.raises(ValueError, match="KVSIDECAR_STORE_SOCKET"):
        ConnectorSettings.from_llm_args(LlmArgs(), {})
    with pytest.raises(ValueError, match="must be numbers"):
        ConnectorSettings.from_llm_args(LlmArgs(), {"KVSIDECAR_STORE_SOCKET": "/s",
                                                    "KVSIDECAR_STORE_TIMEOUT_S": "soon"})


def test_metadata_survives_the_broadcast() -> None:
    """The step metadata pickles (TRT-LLM broadcasts it over MPI)."""
    meta = ConnectorMetadata()
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_without_tensorrt_llm_the_module_imports_and_names_the_extra() -> None:
    """No tensorrt_llm: stand-in bases, and the config helper names the trtllm extra."""
    assert trt.TRTLLM_AVAILABLE is False
    with pytest.raises(MissingExtraError, match=r"kvsidecar\[trtllm\]"):
        trt.kv_connector_config()
    for name in ("get_num_new_matched_tokens", "build_connector_meta", "request_finished",
                 "update_state_after_alloc"):
        assert callable(getattr(trt.KvSidecarConnectorScheduler, name))
    for name in ("register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                 "wait_for_save", "get_finished", "bind_connector_meta"):
        assert callable(getattr(trt.KvSidecarConnectorWorker, name))


@pytest.mark.slow  # real processes, seconds a test
def test_the_hicache_backend_imports_without_sglang() -> None:
    """Without sglang the HiCache backend still imports (for the reference engine)."""
    code = ("import sys; sys.modules['sglang'] = None\n"
            "import adapters.sglang.hicache as h\n"
            "assert h.KvSidecarHiCacheStorage.__mro__[1] is object\n"
            "assert 'sglang.srt' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
