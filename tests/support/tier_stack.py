"""Reference engines with their sidecars, for the KV-tier tests through real processes: the
engine's HiCache hook attached to the sidecar's store, one prefill at a time.

The stacks are ``LocalStack``'s: ``replica("A")`` is one replica whose hook writes through
to its sidecar's store (``stack.store_sockets["A"]``), ``plain("C")`` one with neither::

    async with LocalStack(tier_spec(replica("A"), gateways=(GatewaySpec(),)), tmp) as stack:
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import aiohttp

from kvsidecar.local_stack import DEFAULT_MODEL, EngineSpec, GatewaySpec, StackSpec
from shm import BlockStoreClient

__all__ = [
    "MODEL", "PAGE_BYTES", "PAGE_TOKENS", "generate", "hook_attached", "plain", "replica",
    "tier_spec",
]

MODEL = DEFAULT_MODEL
PAGE_TOKENS = 16
PAGE_BYTES = PAGE_TOKENS * 2048  # the tiny model's KV: 2 KiB per token (fp32)


def replica(name: str, *sidecar_args: str, compute: Literal["sim", "torch"] = "sim",
           store: Literal["hook", "sidecar"] = "hook") -> EngineSpec:
    """Replica ``name``: the reference engine (simulated compute unless ``compute`` says
    torch, the tiny model) with its HiCache hook on its sidecar's store (``store="sidecar"``:
    the store without the hook), the sidecar given ``sidecar_args`` last."""
    return EngineSpec(compute=compute, store=store, worker_ids=(name,),
                      sidecar_args=tuple(sidecar_args))


def plain(name: str, compute: Literal["sim", "torch"] = "torch") -> EngineSpec:
    """Engine ``name`` alone, no sidecar and no hook: what a full prefill answers."""
    return EngineSpec(compute=compute, sidecars=False, worker_ids=(name,))


def tier_spec(*engines: EngineSpec, gateways: Sequence[GatewaySpec] = (),
              redis: bool = False) -> StackSpec:
    """The stack of ``engines``, ``gateways`` over their sidecars, ``redis-server`` for the
    remote tier when asked (every sidecar gets ``--remote-tier-url``)."""
    return StackSpec(engines=engines, gateways=tuple(gateways), redis=redis,
                     log_level="warning")


async def generate(session: aiohttp.ClientSession, url: str, ids: list[int]) -> dict[str, int]:
    """Two greedy tokens after ``ids``; the engine's cached tokens by tier (empty: none)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        meta = (await resp.json())["meta_info"]
    details: dict[str, int] = meta.get("cached_tokens_details", {})
    return details


async def hook_attached(session: aiohttp.ClientSession, url: str,
                        store: BlockStoreClient) -> int:
    """One-page prompts until one is written through the engine's HiCache hook (it retries
    the store once a second until it attaches); the store's puts then."""
    for warmup in range(1000):
        await generate(session, url, [warmup] * (PAGE_TOKENS + 1))
        if store.stats().num_puts:
            return store.stats().num_puts
    raise AssertionError("the engine's HiCache hook never attached")
