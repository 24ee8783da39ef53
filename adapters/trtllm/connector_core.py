"""The TensorRT-LLM KV cache connector's logic, free of ``tensorrt_llm``.

``adapters.trtllm.connector`` wraps these two classes in TRT-LLM's base classes; everything
that decides or moves bytes is here, so it is tested without TRT-LLM installed.

Blocks are keyed canonically: ``(Namespace(model_id, lora, salt).seed, h_i)`` with ``h_i``
the ``BlockHasher(tokens_per_block)`` chain of the request's tokens, the same hashes the
gateway computes, so the store's host-tier events land in the gateway's prefix index as
they are. A worker of a multi-rank engine (TP/PP: each rank holds a slice of every block)
mixes its rank into the namespace (``rank_namespace``). Under attention DP each rank owns
whole blocks of its own requests (its scheduler and worker plan and copy for it alone, as
TRT-LLM runs one scheduler per owner), so every owner keys blocks canonically and all share
one pool: what one rank saved, another loads. Attention DP with pipeline parallelism (owners
of a slice of the layers) is refused at start-up.

Flow, per TRT-LLM's connector contract:

* scheduler ``matched_tokens`` (``get_num_new_matched_tokens``): hash the prompt's full
  blocks past the device match, ask the store which lead (one ``contains`` round trip), and
  report those tokens; never the whole prompt (the engine must compute its last token);
  loads are synchronous (``load_kv_async=False``);
* scheduler ``after_alloc`` (``update_state_after_alloc``): the matched blocks' device ids;
* scheduler ``build_meta`` (``build_connector_meta``): this step's loads and saves, as a
  picklable ``ConnectorMetadata`` (TRT-LLM broadcasts it to every worker);
* worker ``run_step`` (``start_load_kv``): all loads of the step in one ``leased`` round
  trip, all saves in one ``begin_put`` round trip, before the forward pass;
* scheduler ``finished`` (``request_finished``): queue a save of the request's full blocks
  and return True, so TRT-LLM keeps them until the workers report the save
  (``get_finished``); blocks the store already holds are skipped by the put itself.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import xxhash

from adapters.storage.link import StoreLink, StoreMismatchError
from kvcore.hashing import BlockHasher
from shm import BlockStoreClient

__all__ = [
    "BlockTransfer",
    "ConnectorMetadata",
    "ConnectorSettings",
    "SchedulerCore",
    "WorkerCore",
    "rank_namespace",
]

log = structlog.get_logger(component="adapters.trtllm.connector")

ENV_PREFIX = "KVSIDECAR_"
_DEFAULT_TOKENS_PER_BLOCK = 32  # TRT-LLM's KvCacheConfig default
_RANK = struct.Struct("<QII")

Key = tuple[int, int]


def rank_namespace(seed: int, rank: int, world_size: int) -> int:
    """The namespace a rank's slice of a block lives in (the seed itself on one rank)."""
    if world_size <= 1:
        return seed
    return xxhash.xxh3_64_intdigest(_RANK.pack(seed, rank, world_size))


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's settings: TRT-LLM passes only ``llm_args``, so the rest comes from
    environment variables with one prefix (``KVSIDECAR_``):

    * ``KVSIDECAR_STORE_SOCKET`` (required): the block store owner's Unix socket;
    * ``KVSIDECAR_STORE_OWNER_ID``: refuse a store owned by anyone else;
    * ``KVSIDECAR_MODEL_ID``: the blocks' namespace (default: ``llm_args.model``);
    * ``KVSIDECAR_STORE_TIMEOUT_S`` (5), ``KVSIDECAR_STORE_RETRY_S`` (1).

    ``tokens_per_block`` is the engine's (``llm_args.kv_cache_config.tokens_per_block``);
    ``attention_dp`` and ``pipeline_parallel_size`` too (``enable_attention_dp``,
    ``pipeline_parallel_size``).
    """

    socket: Path
    model_id: str
    tokens_per_block: int = _DEFAULT_TOKENS_PER_BLOCK
    owner_id: str | None = None
    timeout_s: float = 5.0
    retry_interval_s: float = 1.0
    attention_dp: bool = False
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("the connector needs a model id (KVSIDECAR_MODEL_ID)")
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if self.timeout_s <= 0 or self.retry_interval_s < 0:
            raise ValueError("KVSIDECAR_STORE_TIMEOUT_S must be > 0 and KVSIDECAR_STORE_RETRY_S"
                             " >= 0")

    @classmethod
    def from_llm_args(cls, llm_args: Any, environ: Mapping[str, str]) -> ConnectorSettings:
        socket = environ.get(f"{ENV_PREFIX}STORE_SOCKET")
        if not socket:
            raise ValueError(
                f"the kvsidecar KV cache connector needs {ENV_PREFIX}STORE_SOCKET: the block "
                "store owner's Unix socket (the sidecar's --store-socket)")
        model = environ.get(f"{ENV_PREFIX}MODEL_ID") or str(getattr(llm_args, "model", "") or "")
        kv_config = getattr(llm_args, "kv_cache_config", None)
        tokens = (getattr(kv_config, "tokens_per_block", None)
                  or getattr(llm_args, "tokens_per_block", None) or _DEFAULT_TOKENS_PER_BLOCK)
        try:
            timeout = float(environ.get(f"{ENV_PREFIX}STORE_TIMEOUT_S", "5"))
            retry = float(environ.get(f"{ENV_PREFIX}STORE_RETRY_S", "1"))
        except ValueError as exc:
            raise ValueError(f"{ENV_PREFIX}STORE_TIMEOUT_S / _RETRY_S must be numbers: {exc}"
                             ) from exc
        return cls(Path(socket), model, int(tokens), environ.get(f"{ENV_PREFIX}STORE_OWNER_ID"),
                   timeout, retry, bool(getattr(llm_args, "enable_attention_dp", False)),
                   int(getattr(llm_args, "pipeline_parallel_size", 1) or 1))

    def slicing(self, rank: int, world_size: int) -> tuple[int, int]:
        """The (rank, world size) a worker's keys are sliced by: its own under TP/PP; none
        under attention DP, where each owner holds whole blocks in one shared pool."""
        if not self.attention_dp:
            return rank, world_size
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "the kvsidecar KV cache connector supports attention DP without pipeline "
                f"parallelism only (pipeline_parallel_size is {self.pipeline_parallel_size})")
        return 0, 1

    def link(self, hook: str) -> StoreLink:
        return StoreLink(self.socket, expected_owner_id=self.owner_id, timeout_s=self.timeout_s,
                         retry_interval_s=self.retry_interval_s, hook=hook)


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to move between device blocks and the store."""

    request_id: int
    block_ids: tuple[int, ...]
    keys: tuple[Key, ...]  # canonical keys; workers add their rank (``rank_namespace``)
    parents: tuple[int | None, ...] = ()  # saves only: each block's predecessor
    token_ids: tuple[tuple[int, ...], ...] = ()  # saves only: each block's tokens


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """What the scheduler tells every worker for one step (picklable)."""

    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()


@dataclass(frozen=True, slots=True)
class _Match:
    first_block: int
    keys: tuple[Key, ...]


@dataclass(slots=True)
class SchedulerCore:
    """The scheduler side (rank 0 under TP, every owner under attention DP): matches prompts
    against the store and plans loads and saves."""

    settings: ConnectorSettings
    link: StoreLink
    hasher: BlockHasher = field(init=False)
    _matches: dict[int, _Match] = field(init=False, default_factory=dict)
    _loads: list[BlockTransfer] = field(init=False, default_factory=list)
    _saves: list[BlockTransfer] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.hasher = BlockHasher(self.settings.tokens_per_block)

    def matched_tokens(self, request_id: int, token_ids: Sequence[int],
                       num_computed_tokens: int, seed: int) -> int:
        """Prompt tokens past the device match whose blocks the store holds (loadable)."""
        self._matches.pop(request_id, None)
        size = self.settings.tokens_per_block
        if num_computed_tokens % size:
            return 0  # a partial device block: TRT-LLM would have to recompute it anyway
        first = num_computed_tokens // size
        usable = (len(token_ids) - 1) // size  # leave the last prompt token to compute
        if usable <= first:
            return 0
        hashes = self.hasher.hash_tokens(list(token_ids[: usable * size]), seed)
        keys = [(seed, h) for h in hashes[first:]]
        no_answer: list[bool] = []
        flags = self.link.call("contains", lambda c: c.contains_many(keys), no_answer)
        held = next((i for i, f in enumerate(flags) if not f), len(flags))
        if held:
            self._matches[request_id] = _Match(first, tuple(keys[:held]))
        return held * size

    def after_alloc(self, request_id: int, block_ids: Sequence[int]) -> None:
        """Turn the request's match into a load into the device blocks it was given."""
        match = self._matches.pop(request_id, None)
        if match is None:
            return
        targets = tuple(block_ids[match.first_block : match.first_block + len(match.keys)])
        if len(targets) != len(match.keys):
            log.error("connector_load_dropped", request_id=request_id,
                      blocks_matched=len(match.keys), blocks_allocated=len(block_ids))
            return
        self._loads.append(BlockTransfer(request_id, targets, match.keys))

    def finished(self, request_id: int, token_ids: Sequence[int], block_ids: Sequence[int],
                 seed: int) -> bool:
        """Queue a save of the request's full blocks; True while the workers still copy."""
        self._matches.pop(request_id, None)
        size = self.settings.tokens_per_block
        count = min(len(token_ids) // size, len(block_ids))
        if count == 0:
            return False
        tokens = list(token_ids[: count * size])
        hashes = self.hasher.hash_tokens(tokens, seed)
        self._saves.append(BlockTransfer(
            request_id, tuple(block_ids[:count]), tuple((seed, h) for h in hashes),
            (None, *hashes[:-1]),
            tuple(tuple(tokens[i * size : (i + 1) * size]) for i in range(count))))
        return True

    def build_meta(self) -> ConnectorMetadata:
        meta = ConnectorMetadata(tuple(self._loads), tuple(self._saves))
        self._loads.clear()
        self._saves.clear()
        return meta


class WorkerCore:
    """Every rank: copies its slice of each block between the KV pool and the store."""

    def __init__(self, link: StoreLink, rank: int = 0, world_size: int = 1) -> None:
        self.link = link
        self.rank, self.world_size = rank, world_size
        self._kv: torch.Tensor | None = None
        self._rows: np.ndarray | None = None  # CPU pools: (blocks, block bytes) uint8 view
        self._saved: set[int] = set()  # saves done, not yet reported
        self._announced: set[int] = set()  # ids TRT-LLM handed to get_finished as saving
        link.check = self._check_store

    @property
    def block_bytes(self) -> int:
        if self._kv is None:
            raise RuntimeError("register_kv_caches was not called")
        return self._kv[0].numel() * self._kv.element_size()

    def register(self, kv_cache: torch.Tensor) -> None:
        """The engine's KV pool: ``kv_cache[block_id]`` is one block (all its layers)."""
        self._kv = kv_cache
        if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
            self._rows = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8).numpy()
        log.info("connector_kv_registered", blocks=kv_cache.shape[0],
                 block_bytes=self.block_bytes, dtype=str(kv_cache.dtype),
                 device=str(kv_cache.device), rank=self.rank)
        self.link.connect(strict=True, fresh=True)

    def _check_store(self, client: BlockStoreClient) -> None:
        if self._kv is None:
            return
        dtype = str(self._kv.dtype).removeprefix("torch.")
        if client.block_bytes != self.block_bytes:
            raise StoreMismatchError(
                f"the store's blocks are {client.block_bytes} bytes; one TensorRT-LLM KV block "
                f"of this rank is {self.block_bytes}: start the store with --block-bytes "
                f"{self.block_bytes}")
        if client.dtype not in (dtype, "uint8"):
            raise StoreMismatchError(f"the store holds {client.dtype} blocks; the KV pool is "
                                     f"{dtype}")
        if client.welcome.layout != "raw":
            raise StoreMismatchError(
                "TensorRT-LLM blocks are stored in the engine's own order; run the store "
                f"with --layout raw (the sidecar's --store-layout raw; it declares "
                f"{client.welcome.layout!r})")

    def _rank_keys(self, keys: Sequence[Key]) -> list[Key]:
        if self.world_size <= 1:
            return list(keys)
        return [(rank_namespace(s, self.rank, self.world_size), h) for s, h in keys]

    def run_step(self, meta: ConnectorMetadata | None, stream: Any = None) -> None:
        """Before the forward pass: this step's loads, then its saves (one round trip each)."""
        if meta is None or self._kv is None:
            return
        if meta.loads:
            self._load(meta.loads)
        if meta.saves:
            if stream is not None and hasattr(stream, "synchronize"):
                stream.synchronize()  # the finished requests' last KV writes are done
            self._save(meta.saves)
            self._saved.update(t.request_id for t in meta.saves)

    def _load(self, transfers: Sequence[BlockTransfer]) -> None:
        keys = self._rank_keys([k for t in transfers for k in t.keys])
        blocks = [b for t in transfers for b in t.block_ids]

        def get(client: BlockStoreClient) -> int:
            return self._copy_in(client, keys, blocks)

        loaded = self.link.call("load", get, 0)
        self.link.counters.blocks_loaded += loaded
        self.link.counters.blocks_missed += len(keys) - loaded
        if loaded < len(keys):
            # TRT-LLM was told these tokens would be there; the model now reads stale KV for
            # them. Logged loudly: it means the store evicted or lost blocks in between.
            log.error("connector_load_short", blocks_expected=len(keys), blocks_loaded=loaded)

    def _save(self, transfers: Sequence[BlockTransfer]) -> None:
        keys = self._rank_keys([k for t in transfers for k in t.keys])
        blocks = [b for t in transfers for b in t.block_ids]
        parents = [p for t in transfers for p in t.parents]
        tokens = [list(x) for t in transfers for x in t.token_ids]

        def put(client: BlockStoreClient) -> list[bool]:
            with client.begin_put(keys, parent_hashes=parents, token_ids=tokens) as pending:
                self._copy_out([(b, v) for b, v in zip(blocks, pending.views, strict=True)
                                if v is not None])
            return pending.stored

        no_answer: list[bool] = []
        stored = self.link.call("save", put, no_answer)
        self.link.counters.blocks_stored += sum(stored)
        self.link.counters.blocks_present += len(stored) - sum(stored)

    def _copy_in(self, client: BlockStoreClient, keys: list[Key],
                 blocks: list[int]) -> int:
        """Copy the held ``keys`` into KV blocks ``blocks``; how many were held.

        ``client.read`` reads blocks this worker saved itself without a store round trip,
        and may hand a key over twice (a slot evicted mid-copy is read again under a lease):
        every copy here overwrites."""
        if self._rows is not None:  # host KV: straight into the block's rows
            rows = self._rows
            return client.read(keys, lambda i, view: np.copyto(rows[blocks[i]], view)).count(True)
        kv = self._kv
        assert kv is not None
        staging = torch.empty((len(keys), self.block_bytes), dtype=torch.uint8,
                              pin_memory=kv.is_cuda)
        staged = staging.numpy()
        hits = client.read(keys, lambda i, view: np.copyto(staged[i], view))
        held = [i for i, hit in enumerate(hits) if hit]
        if held:
            index = torch.tensor([blocks[i] for i in held], dtype=torch.long, device=kv.device)
            flat = kv.view(kv.shape[0], -1).view(torch.uint8)
            flat.index_copy_(0, index, staging[held].to(kv.device, non_blocking=False))
        return len(held)

    def _copy_out(self, slots: list[tuple[int, np.ndarray]]) -> None:
        if not slots:
            return
        if self._rows is not None:
            for block, view in slots:
                np.copyto(view, self._rows[block])
            return
        kv = self._kv
        assert kv is not None
        index = torch.tensor([b for b, _ in slots], dtype=torch.long, device=kv.device)
        gathered = kv.view(kv.shape[0], -1).view(torch.uint8).index_select(0, index).cpu()
        rows = gathered.numpy()
        for i, (_, view) in enumerate(slots):
            np.copyto(view, rows[i])

    def finished(self, finished_gen_req_ids: Sequence[int],
                 started_loading_req_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Saves done for requests TRT-LLM announced; loads are never asynchronous."""
        self._announced.update(finished_gen_req_ids)
        done = self._saved & self._announced
        self._saved -= done
        self._announced -= done
        return sorted(done), []
