"""What ``kvsidecar indexer`` follows: registered KV event publishers, into one prefix index.

Each ``POST /register`` is one DP rank of one instance under one tenant, keyed as the RFC's
``/unregister`` answer names it: ``"<instance_id>|<tenant_id>|<dp_rank>"``, which is also its
worker id in the ``PrefixIndex`` (the gateway's, ``routing.placement``). Its publisher is
read by the engines' own adapter code (``adapters.zmq_events``: live SUB, replay, gaps and
restarts; vLLM's or SGLang's batch decoder), which re-hashes every stored block canonically
from its tokens (``adapters.normalize``): the index holds the hashes the gateway's holds.

The registration's ``lora_name`` and ``additionalsalt`` are the namespace of the blocks its
events do not name one for (the RFC: registration metadata supplies what the event lacks); an
event's own LoRA name or cache salt wins. ``modelname`` is the model of the namespace.

Events leave the adapter unstamped; a sidecar's relay would stamp them, and here, with no
relay and no subscriber of our own, the registration does: a new epoch per registration, the
next seq per event (``PrefixIndex.apply`` needs both).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import zmq.asyncio

from adapters.base import EventEndpoint
from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.core import RankNormalizer as SglangRankNormalizer
from adapters.vllm.core import VllmRankNormalizer
from adapters.zmq_events.context import close_context
from adapters.zmq_events.subscriber import RankCore, RankSubscriber
from kvcore import BlockHasher
from kvcore.errors import OpenAIError
from kvcore.events import KVEvent, Tier
from routing.indexer.answer import INSTANCE_NOT_FOUND, Rank
from routing.indexer.requests import Registration, Unregistration
from routing.indexer.rolling_hashes import DEFAULT_XXH3_SEED, RollingHashMap
from routing.placement.prefix_index import PrefixIndex

__all__ = ["PUBLISHER_TYPES", "Registrations", "registration_key"]

log = structlog.get_logger(component="indexer")

# The RFC's publisher types we read, by lower-cased name → how the RFC spells it.
PUBLISHER_TYPES = {"vllm": "vLLM", "sglang": "SGLang"}
_ZMQ_SCHEMES = ("tcp://", "ipc://")  # what the engines' publishers bind


def registration_key(instance_id: str, tenant_id: str, dp_rank: int) -> str:
    """The RFC's name of one registration (``removed_instances``), our worker id for it."""
    return f"{instance_id}|{tenant_id}|{dp_rank}"


class _RegisteredNormalizer(WorkerNormalizer):
    """A ``WorkerNormalizer`` whose namespace defaults to the registration's LoRA and salt."""

    __slots__ = ("_default_lora", "_default_salt")

    def __init__(self, worker_id: str, reg: Registration, hasher: BlockHasher,
                 metrics: AdapterMetrics) -> None:
        super().__init__(worker_id, reg.modelname, hasher, metrics)
        self._default_lora = reg.lora_name
        self._default_salt = reg.additionalsalt

    def stored(
        self,
        engine_hashes: Sequence[int],
        engine_parent: int | None,
        token_ids: list[int],
        tier: Tier,
        out: list[KVEvent],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        locals_: Sequence[int] | None = None,
    ) -> None:
        super().stored(engine_hashes, engine_parent, token_ids, tier, out,
                       lora_name=lora_name or self._default_lora,
                       cache_salt=cache_salt or self._default_salt, locals_=locals_)


@dataclasses.dataclass(slots=True)
class _Followed:
    """One registration and the subscriber reading its publisher."""

    reg: Registration
    subscriber: RankSubscriber
    task: asyncio.Task[None] | None = None
    epoch: int = dataclasses.field(default_factory=lambda: time.time_ns() // 1000)
    seq: int = 0
    error: str | None = None


class Registrations:
    """The registered publishers, their subscribers, and the index they feed."""

    def __init__(self, *, replay_timeout_s: float = 2.0, idle_probe_s: float = 1.0,
                 xxh3_seed: int = DEFAULT_XXH3_SEED) -> None:
        self.index = PrefixIndex()
        # Every stored block's XXH3 rolling hash too, for /query_by_hash in the RFC's scheme.
        self.rolling = RollingHashMap(xxh3_seed)
        self.index.observer = self.rolling
        self.metrics = AdapterMetrics("indexer")
        self._replay_timeout_s = replay_timeout_s
        self._idle_probe_s = idle_probe_s
        self._ctx = zmq.asyncio.Context()
        self._followed: dict[str, _Followed] = {}
        self._hashers: dict[int, BlockHasher] = {}

    def hasher(self, block_size: int) -> BlockHasher:
        """The one hasher of a block size (shared by subscribers and queries)."""
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size)
        return hasher

    # --- commands -------------------------------------------------------------------------

    def register(self, reg: Registration) -> str:
        """Follow ``reg``'s publisher; returns its key. 409 if the key is followed already,
        400 for a publisher type we cannot read."""
        kind = PUBLISHER_TYPES.get(reg.type.lower())
        if kind is None:
            raise OpenAIError(400, f"POST /register: publisher type {reg.type!r} is not read "
                              f"here; known: {list(PUBLISHER_TYPES.values())} (vLLM's and "
                              "SGLang's ZMQ KV events)", param="type")
        for name, address in (("endpoint", reg.endpoint),
                              ("replay_endpoint", reg.replay_endpoint)):
            if address is not None and not address.startswith(_ZMQ_SCHEMES):
                raise OpenAIError(400, f"POST /register: '{name}' {address!r} is no ZMQ "
                                  f"endpoint; it starts with one of {list(_ZMQ_SCHEMES)}",
                                  param=name)
        if reg.hash_seed is not None and reg.hash_seed != self.rolling.seed:
            raise OpenAIError(400, f"POST /register: 'hash_seed' is {reg.hash_seed}, but this "
                              f"indexer keeps XXH3 rolling hashes with seed {self.rolling.seed} "
                              "(kvsidecar indexer --xxh3-seed)", param="hash_seed")
        key = registration_key(reg.instance_id, reg.tenant_id, reg.dp_rank)
        if key in self._followed:
            raise OpenAIError(409, f"POST /register: {key!r} (instance|tenant|dp_rank) is "
                              "registered already; POST /unregister it first", param="instance_id",
                              code="already_registered")
        norm = _RegisteredNormalizer(key, reg, self.hasher(reg.block_size), self.metrics)
        core: RankCore = (VllmRankNormalizer(norm, self.metrics) if kind == "vLLM"
                          else SglangRankNormalizer(norm, self.metrics))
        endpoint = EventEndpoint(reg.dp_rank, reg.endpoint, reg.replay_endpoint)
        followed = _Followed(reg, RankSubscriber(
            endpoint, self._ctx, core, lambda events: self._apply(key, events), self.metrics,
            replay_timeout_s=self._replay_timeout_s, idle_probe_s=self._idle_probe_s))
        followed.task = asyncio.get_running_loop().create_task(
            self._follow(key, followed), name=f"indexer {key}")
        self._followed[key] = followed
        log.info("publisher_registered", worker_id=key, endpoint=reg.endpoint, type=kind,
                 model=reg.modelname, block_size=reg.block_size)
        return key

    async def unregister(self, unreg: Unregistration) -> list[str]:
        """Stop following ``(instance_id, tenant_id, dp_rank)`` and forget its blocks; 404
        when it is not registered, 400 when its type, model, block size or LoRA name are not
        the registration's."""
        key = registration_key(unreg.instance_id, unreg.tenant_id, unreg.dp_rank)
        followed = self._followed.get(key)
        if followed is None:
            raise OpenAIError(404, f"POST /unregister: {key!r} (instance|tenant|dp_rank) is not "
                              f"registered; registered: {sorted(self._followed)}",
                              param="instance_id", code=INSTANCE_NOT_FOUND)
        reg = followed.reg
        for name, asked, held in (("type", unreg.type.lower(), reg.type.lower()),
                                  ("modelname", unreg.modelname, reg.modelname),
                                  ("block_size", unreg.block_size, reg.block_size),
                                  ("lora_name", unreg.lora_name, reg.lora_name)):
            if asked != held:
                raise OpenAIError(400, f"POST /unregister: {key!r} was registered with "
                                  f"{name} {held!r}, not {asked!r}", param=name)
        del self._followed[key]
        await _cancel(followed.task)
        self.index.remove_worker(key)
        log.info("publisher_unregistered", worker_id=key)
        return [key]

    async def aclose(self) -> None:
        for followed in list(self._followed.values()):
            await _cancel(followed.task)
        self._followed.clear()
        await close_context(self._ctx, owner="indexer")

    # --- queries --------------------------------------------------------------------------

    def instances(self, tenant_id: str, model: str, block_size: int) -> dict[str, list[Rank]]:
        """The instances registered under ``tenant_id`` for ``model`` in blocks of
        ``block_size``, each with its DP ranks."""
        out: dict[str, list[Rank]] = {}
        for key, followed in self._followed.items():
            reg = followed.reg
            if (reg.tenant_id, reg.modelname, reg.block_size) == (tenant_id, model, block_size):
                out.setdefault(reg.instance_id, []).append(Rank(reg.dp_rank, key))
        return out

    def models(self) -> dict[str, set[int]]:
        """Every registered model and its block sizes."""
        out: dict[str, set[int]] = {}
        for followed in self._followed.values():
            out.setdefault(followed.reg.modelname, set()).add(followed.reg.block_size)
        return out

    def state(self) -> list[dict[str, Any]]:
        """``GET /workers``: every registration, whether its publisher is connected, what
        the index holds of it (per tier; ``xxh3_blocks``: those ``/query_by_hash`` finds by
        their XXH3 rolling hashes, counted once per tier)."""
        known = set(self.index.worker_ids)
        return [
            {
                "key": key,
                **dataclasses.asdict(f.reg),
                "connected": f.error is None and f.subscriber.connected.is_set(),
                "error": f.error,
                "cached_blocks": {t.name.lower(): self.index.num_blocks(key, t) if key in known
                                  else 0 for t in Tier},
                "xxh3_blocks": self.rolling.num_translated(key),
            }
            for key, f in self._followed.items()
        ]

    # --- the event path -------------------------------------------------------------------

    async def _apply(self, key: str, events: list[KVEvent]) -> None:
        followed = self._followed.get(key)
        if followed is None:  # unregistered while its last batch was in hand
            return
        for event in events:
            followed.seq += 1
            self.index.apply(msgspec.structs.replace(
                event, worker_id=key, epoch=followed.epoch, seq=followed.seq))

    async def _follow(self, key: str, followed: _Followed) -> None:
        try:
            await followed.subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the loop boundary: say so, keep the others
            followed.error = repr(exc)
            log.exception("publisher_follow_failed", worker_id=key)
            self.index.remove_worker(key)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait([task])  # its CancelledError stays in it; ours would propagate
