"""Reference engines with their sidecars, for the KV-tier tests through real processes: the
engine's HiCache hook attached to the sidecar's store, one prefill at a time."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from kvsidecar.launch import ManagedProcess
from shm import BlockStoreClient
from tests.support.processes import ProcessGroup

__all__ = [
    "EVENTS", "MODEL", "PAGE_BYTES", "PAGE_TOKENS", "engine_argv", "generate", "hook_attached",
    "start",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "refengine" / "models" / "tiny"
PAGE_TOKENS = 16
PAGE_BYTES = PAGE_TOKENS * 2048  # the tiny model's KV: 2 KiB per token (fp32)
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})


def start(procs: ProcessGroup[ManagedProcess], name: str, argv: list[str],
          tmp: Path) -> ManagedProcess:
    proc = procs.add(ManagedProcess.start(name, argv, workdir=tmp))
    proc.wait_ready(60)
    return proc


def engine_argv(socket: Path, compute: str = "sim") -> list[str]:
    """The reference engine (simulated compute unless ``compute`` says torch, the tiny model)
    with its HiCache hook on the sidecar store at ``socket``."""
    hook = {"backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
            "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "socket": str(socket),
            "model_id": "tiny"}
    return ["refengine", "--compute", compute, "--model-path", str(MODEL), "--port", "0",
            "--kv-events-config", EVENTS, "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(hook)]


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
