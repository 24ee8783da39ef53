"""The vLLM KV connector's logic, free of ``vllm``: what to load and save, and the bytes.

``adapters.vllm.connector`` wraps these two classes in vLLM's ``KVConnectorBase_V1``;
everything that decides or moves bytes is here, so it is tested without vLLM installed.

Keys are canonical: ``(namespace seed, h_i)`` with the seed from (model id, LoRA name, cache
salt) and ``h_i`` the ``kvcore.hashing.BlockHasher`` chain of the prompt's tokens, the hashes
the gateway computes; so the store's host, disk and remote-tier events land in the gateway's
prefix index as they are, and a block one replica saved is found by every other.

A stored block is one vLLM KV block of every attention layer: the layers in the order vLLM
registers them, each its block's bytes in the attention backend's own order
(``BlockRows``; the store's ``raw`` layout). On the CPU backend that is ``[kv_heads][k|v]
[block_size][head_dim]`` per layer.

Flow, per vLLM's connector contract (scheduler and worker may be separate processes):

* scheduler ``matched_tokens`` (``get_num_new_matched_tokens``): hash the prompt's full
  blocks past the device match, ask the store which lead (one ``contains`` round trip, which
  spans its disk and remote tiers), report those tokens, never the whole prompt (vLLM
  computes at least its last token); loads are synchronous;
* scheduler ``after_alloc`` (``update_state_after_alloc``): the request's prompt and
  namespace, and a load of the matched blocks into the device blocks they were given;
* scheduler ``plan_step`` (``build_connector_meta``): this step's loads, and saves of the
  prompt blocks this step completes (a ``StepPlan``, picklable);
* worker ``load`` (``start_load_kv``): all the step's loads in one read, before the forward
  pass; blocks the store no longer had are reported back (``get_block_ids_with_load_errors``)
  and vLLM recomputes them (``kv_load_failure_policy: recompute``);
* worker ``save`` (``wait_for_save``): all the step's saves in one ``begin_put``, after the
  forward pass wrote their KV; blocks the store holds already are skipped by the put.

Saves are synchronous, inside the step, so a finished request's blocks are never held back.
Only prompt blocks are saved: they are what a later request's prompt can share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from adapters.storage.hook_config import StoreHookConfig
from adapters.storage.link import StoreLink, StoreMismatchError
from kvcore.hashing import BlockHasher
from shm import BlockStoreClient

__all__ = [
    "BlockRows",
    "BlockTransfer",
    "ConnectorSettings",
    "ScheduledRequest",
    "SchedulerCore",
    "StepPlan",
    "WorkerCore",
    "block_keys",
    "loadable_blocks",
]

log = structlog.get_logger(component="adapters.vllm.connector")

Key = tuple[int, int]

# vLLM's own keys of KVTransferConfig.kv_connector_extra_config that we pass over
_VLLM_KEYS = frozenset({"discard_partial_chunks"})


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's settings: the store (``kv_connector_extra_config``, see
    ``StoreHookConfig``), the blocks' model id (its ``model_id``, else vLLM's served model
    name) and vLLM's block size."""

    store: StoreHookConfig
    model_id: str
    block_size: int

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("the kvsidecar KV connector needs a model id (extra config "
                             '"model_id", or vLLM\'s --served-model-name)')
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, served_model_name: str,
                          block_size: int) -> ConnectorSettings:
        store = StoreHookConfig.parse(extra, hook="kvsidecar KV connector",
                                      engine_keys=_VLLM_KEYS)
        return cls(store, store.model_id or served_model_name, block_size)

    def link(self, hook: str) -> StoreLink:
        s = self.store
        return StoreLink(s.socket, expected_owner_id=s.owner_id, timeout_s=s.timeout_s,
                         retry_interval_s=s.retry_interval_s, hook=hook)


def loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a load may cover: never the last prompt token's, which vLLM must
    compute to sample the first output token."""
    return max(num_prompt_tokens - 1, 0) // block_size


def block_keys(hasher: BlockHasher, token_ids: Sequence[int], seed: int,
               num_blocks: int) -> list[Key]:
    """The canonical keys of the first ``num_blocks`` blocks of ``token_ids``."""
    hashes = hasher.hash_tokens(list(token_ids[: num_blocks * hasher.block_size]), seed)
    return [(seed, h) for h in hashes]


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to move between vLLM's KV blocks and the store."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[Key, ...]
    parents: tuple[int | None, ...] = ()  # saves only: each block's predecessor
    token_ids: tuple[tuple[int, ...], ...] = ()  # saves only: each block's tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the scheduler tells the workers for one step (picklable)."""

    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a step, as the scheduler hands it to ``plan_step``."""

    request_id: str
    num_tokens_after_step: int  # computed tokens once this step ran (vLLM's count + scheduled)
    block_ids: Sequence[int]  # its device blocks, in order


@dataclass(slots=True)
class _Match:
    first_block: int
    keys: list[Key]


@dataclass(slots=True)
class _Prompt:
    """A running request's prompt as the scheduler saves it."""

    token_ids: list[int]
    seed: int
    keys: list[Key]  # every full prompt block's
    saved_blocks: int = 0  # leading blocks already put (or planned)


@dataclass(slots=True)
class SchedulerCore:
    """The scheduler side: matches prompts against the store, plans loads and saves."""

    settings: ConnectorSettings
    link: StoreLink
    hasher: BlockHasher = field(init=False)
    _matches: dict[str, _Match] = field(init=False, default_factory=dict)
    _prompts: dict[str, _Prompt] = field(init=False, default_factory=dict)
    _loads: list[BlockTransfer] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.hasher = BlockHasher(self.settings.block_size)

    def matched_tokens(self, request_id: str, prompt: Sequence[int], num_computed_tokens: int,
                       seed: int) -> int:
        """Prompt tokens past the device's ``num_computed_tokens`` whose blocks the store
        holds (a miss, 0, when it is down)."""
        self._matches.pop(request_id, None)
        size = self.settings.block_size
        if num_computed_tokens % size:
            return 0  # vLLM hands us a block-aligned count; anything else is not ours to fill
        first = num_computed_tokens // size
        usable = loadable_blocks(len(prompt), size)
        if usable <= first:
            return 0
        keys = block_keys(self.hasher, prompt, seed, usable)[first:]
        no_answer: list[bool] = []
        flags = self.link.call("contains", lambda c: c.contains_many(keys), no_answer)
        held = next((i for i, f in enumerate(flags) if not f), len(flags))
        if held:
            self._matches[request_id] = _Match(first, keys[:held])
        return held * size

    def after_alloc(self, request_id: str, prompt: Sequence[int], seed: int,
                    block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The request is scheduled with ``block_ids``: remember its prompt for saving, and
        turn its match into a load when vLLM took it (``num_external_tokens``)."""
        size = self.settings.block_size
        if request_id not in self._prompts:
            full = len(prompt) // size
            self._prompts[request_id] = _Prompt(
                list(prompt), seed, block_keys(self.hasher, prompt, seed, full))
        match = self._matches.pop(request_id, None)
        if match is None or num_external_tokens <= 0:
            return
        count = min(num_external_tokens // size, len(match.keys))
        targets = tuple(block_ids[match.first_block : match.first_block + count])
        if len(targets) != count:
            log.error("connector_load_dropped", request_id=request_id, blocks_matched=count,
                      blocks_allocated=len(block_ids))
            return
        self._loads.append(BlockTransfer(request_id, targets, tuple(match.keys[:count])))

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        """This step's loads, and saves of the prompt blocks it completes."""
        size = self.settings.block_size
        saves = []
        for req in scheduled:
            prompt = self._prompts.get(req.request_id)
            if prompt is None:
                continue
            done = min(req.num_tokens_after_step, len(prompt.token_ids)) // size
            done = min(done, len(req.block_ids), len(prompt.keys))
            start = prompt.saved_blocks
            if done <= start:
                continue
            prompt.saved_blocks = done
            keys = prompt.keys[start:done]
            tokens = prompt.token_ids
            saves.append(BlockTransfer(
                req.request_id, tuple(req.block_ids[start:done]), tuple(keys),
                (None if start == 0 else prompt.keys[start - 1][1],
                 *(h for _, h in keys[:-1])),
                tuple(tuple(tokens[i * size : (i + 1) * size]) for i in range(start, done))))
        plan = StepPlan(tuple(self._loads), tuple(saves))
        self._loads.clear()
        return plan

    def finished(self, request_id: str) -> None:
        self._matches.pop(request_id, None)
        self._prompts.pop(request_id, None)


class BlockRows:
    """vLLM's per-layer KV tensors seen as rows of bytes: row ``b`` of layer ``j`` is that
    layer's KV of block ``b``; a stored block is the rows of every layer, in order."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int | None = None) -> None:
        if not layers:
            raise ValueError("the kvsidecar KV connector got no KV cache layers")
        self.rows: list[torch.Tensor] = [self._rows(t, num_blocks) for t in layers]
        counts = {r.shape[0] for r in self.rows}
        if len(counts) != 1:
            raise ValueError(f"KV cache layers hold different block counts: {sorted(counts)}")
        self.num_blocks = counts.pop()
        self.layer_bytes = [r.shape[1] for r in self.rows]
        self.offsets = np.cumsum([0, *self.layer_bytes]).tolist()
        self.block_bytes = int(self.offsets[-1])
        self.dtype = str(layers[0].dtype).removeprefix("torch.")
        self.device = layers[0].device
        # host tensors: numpy views, copied without torch
        self.host_rows = ([r.numpy() for r in self.rows] if self.device.type == "cpu"
                          else None)

    @staticmethod
    def _rows(layer: torch.Tensor, num_blocks: int | None) -> torch.Tensor:
        """``layer`` as a ``(blocks, block bytes)`` uint8 view (blocks on its first axis)."""
        if num_blocks is not None and layer.shape[0] != num_blocks:
            raise ValueError(
                f"a KV cache layer of shape {tuple(layer.shape)} does not hold one block per "
                f"row of its first axis ({num_blocks} blocks): the kvsidecar KV connector "
                "supports attention backends whose per-layer cache is block-major (CPU)")
        if layer.dim() < 2 or not layer[0].is_contiguous():
            raise ValueError(f"a KV cache layer's block is not contiguous (shape "
                             f"{tuple(layer.shape)}, strides {layer.stride()})")
        per_block = layer[0].numel()
        flat = layer.as_strided((layer.shape[0], per_block), (layer.stride(0), 1))
        return flat.view(torch.uint8)

    def copy_in(self, block: int, src: np.ndarray) -> None:
        """One stored block into device block ``block`` (host tensors)."""
        assert self.host_rows is not None
        off = self.offsets
        for j, rows in enumerate(self.host_rows):
            np.copyto(rows[block], src[off[j] : off[j + 1]])

    def copy_out(self, block: int, dst: np.ndarray) -> None:
        """Device block ``block`` into one store slot (host tensors)."""
        assert self.host_rows is not None
        off = self.offsets
        for j, rows in enumerate(self.host_rows):
            np.copyto(dst[off[j] : off[j + 1]], rows[block])

    def scatter(self, blocks: Sequence[int], staged: torch.Tensor) -> None:
        """Staged host rows (``len(blocks)`` × block bytes) into device blocks ``blocks``."""
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        moved = staged.to(self.device)
        off = self.offsets
        for j, rows in enumerate(self.rows):
            rows.index_copy_(0, index, moved[:, off[j] : off[j + 1]])

    def gather(self, blocks: Sequence[int]) -> np.ndarray:
        """Device blocks ``blocks`` as host rows (``len(blocks)`` × block bytes)."""
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        parts = [rows.index_select(0, index) for rows in self.rows]
        return torch.cat(parts, dim=1).cpu().numpy()


class WorkerCore:
    """The worker side: copies blocks between vLLM's KV cache and the store."""

    def __init__(self, link: StoreLink) -> None:
        self.link = link
        self.rows: BlockRows | None = None
        self._failed: set[int] = set()  # device blocks a load did not fill, not yet reported
        link.check = self._check_store

    def register(self, layers: Sequence[torch.Tensor], num_blocks: int | None = None) -> None:
        """vLLM's KV cache, one tensor per attention layer (its registration order)."""
        rows = self.rows = BlockRows(layers, num_blocks)
        log.info("connector_kv_registered", layers=len(layers), blocks=rows.num_blocks,
                 block_bytes=rows.block_bytes, dtype=rows.dtype, device=str(rows.device))
        self.link.connect(strict=True, fresh=True)  # a store that does not fit fails start-up

    def _check_store(self, client: BlockStoreClient) -> None:
        rows = self.rows
        if rows is None:
            return
        if client.block_bytes != rows.block_bytes:
            raise StoreMismatchError(
                f"the store's blocks are {client.block_bytes} bytes; one vLLM KV block of "
                f"every layer is {rows.block_bytes}: start the store with --store-block-bytes "
                f"{rows.block_bytes}")
        if client.dtype not in (rows.dtype, "uint8"):
            raise StoreMismatchError(f"the store holds {client.dtype} blocks; vLLM's KV cache "
                                     f"is {rows.dtype}")
        if client.welcome.layout != "raw":
            raise StoreMismatchError(
                "vLLM blocks are stored in the attention backend's own order; run the store "
                f"with --store-layout raw (it declares {client.welcome.layout!r})")

    def load(self, plan: StepPlan | None) -> None:
        """Before the forward pass: the step's loads, in one read."""
        if plan is None or not plan.loads or self.rows is None:
            return
        keys = [k for t in plan.loads for k in t.keys]
        blocks = [b for t in plan.loads for b in t.block_ids]
        no_answer = [False] * len(keys)
        hits = self.link.call("load", lambda c: self._copy_in(c, keys, blocks), no_answer)
        loaded = sum(hits)
        self.link.counters.blocks_loaded += loaded
        self.link.counters.blocks_missed += len(keys) - loaded
        if loaded < len(keys):
            # vLLM was told these tokens would be there: it recomputes them from the first
            # block missing (the store evicted or lost them in between, or went down)
            self._failed.update(b for b, hit in zip(blocks, hits, strict=True) if not hit)
            log.warning("connector_load_short", blocks_expected=len(keys),
                        blocks_loaded=loaded)

    def take_failed_blocks(self) -> set[int]:
        """Device blocks loads left unfilled since the last call (for vLLM to recompute)."""
        failed, self._failed = self._failed, set()
        return failed

    def save(self, plan: StepPlan | None) -> None:
        """After the forward pass: the step's saves, in one put."""
        if plan is None or not plan.saves or self.rows is None:
            return
        rows = self.rows
        keys = [k for t in plan.saves for k in t.keys]
        blocks = [b for t in plan.saves for b in t.block_ids]
        parents = [p for t in plan.saves for p in t.parents]
        tokens = [list(x) for t in plan.saves for x in t.token_ids]

        def put(client: BlockStoreClient) -> list[bool]:
            with client.begin_put(keys, parent_hashes=parents, token_ids=tokens) as pending:
                slots = [(b, v) for b, v in zip(blocks, pending.views, strict=True)
                         if v is not None]
                if rows.host_rows is not None:
                    for block, view in slots:
                        rows.copy_out(block, view)
                elif slots:
                    gathered = rows.gather([b for b, _ in slots])
                    for i, (_, view) in enumerate(slots):
                        np.copyto(view, gathered[i])
            return pending.stored

        no_answer: list[bool] = []
        stored = self.link.call("save", put, no_answer)
        self.link.counters.blocks_stored += sum(stored)
        self.link.counters.blocks_present += len(stored) - sum(stored)

    def _copy_in(self, client: BlockStoreClient, keys: list[Key], blocks: list[int]
                 ) -> list[bool]:
        """Copy the held ``keys`` into device blocks ``blocks``; per key, whether it was held.
        ``client.read`` may hand a key over twice (a slot retracted mid-copy is read again
        under a lease): every copy overwrites."""
        rows = self.rows
        assert rows is not None
        if rows.host_rows is not None:
            return client.read(keys, lambda i, view: rows.copy_in(blocks[i], view))
        staging = torch.empty((len(keys), rows.block_bytes), dtype=torch.uint8,
                              pin_memory=rows.device.type == "cuda")
        staged = staging.numpy()
        hits = client.read(keys, lambda i, view: np.copyto(staged[i], view))
        held = [i for i, hit in enumerate(hits) if hit]
        if held:
            rows.scatter([blocks[i] for i in held], staging[held])
        return hits
