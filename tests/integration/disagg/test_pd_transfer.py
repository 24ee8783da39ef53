"""The KV handoff through the sidecars' block stores: the decode sidecar pulls the blocks.

Each engine's storage hook is its own sidecar's shared-memory store (the HiCache backend in
``adapters/sglang/hicache.py``); the prefill engine exports the prompt's pages there, the
decode sidecar pulls them into its store (``--kv-handoff transfer``) and its engine imports
them through its hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvsidecar.local_stack import EngineSpec, LocalStack
from tests.integration.disagg.pd_stack import answer_text, complete, gateway, pd_stack, routable
from tests.support.polling import eventually


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    s = pd_stack(tmp_path, ["agg", EngineSpec(role="prefill", handoff="sidecar"),
                            EngineSpec(role="decode", handoff="sidecar")], compute="torch")
    try:
        yield s
    finally:
        s.stop()


async def _pulled_bytes(session: aiohttp.ClientSession, sidecar: str, transport: str) -> float:
    async with session.get(f"{sidecar}/metrics") as resp:
        text = await resp.text()
    name = f'kvsidecar_transfer_bytes_total{{outcome="ok",transport="{transport}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def _hooks_attached(session: aiohttp.ClientSession, url: str) -> None:
    """Poll with a throwaway request until the engines' hooks reach their stores (a hook
    retries its store once a second; the engine starts before its sidecar's store)."""
    attempts = iter(range(1, 1 << 30))

    async def served() -> bool:
        status, _, body = await complete(session, url, f"warm up {next(attempts)} " * 12, 2)
        assert status in (200, 502), body
        assert status == 200 or body["error"]["code"] == "kv_transfer_failed", body
        return status == 200

    await eventually(served, "the engines' hooks to attach to their stores")


@pytest.mark.slow
async def test_pulled_blocks_continue_exactly_as_aggregated(stack, session) -> None:  # type: ignore[no-untyped-def]
    """Greedy output is identical to aggregated serving, over shm, tcp and nixl (or its tcp
    fallback) pulls."""
    shm = gateway(stack, "gateway-shm", "--kv-load-failure-policy", "fail")
    tcp = gateway(stack, "gateway-tcp", "--kv-load-failure-policy", "fail",
                  "--kv-transport", "tcp")
    nixl = gateway(stack, "gateway-nixl", "--kv-load-failure-policy", "fail",
                   "--kv-transport", "nixl")
    agg = gateway(stack, "gateway-agg", "--pd-mode", "off")
    for url in (shm, tcp, nixl, agg):
        await routable(session, url, 3)
    await _hooks_attached(session, shm)
    decode = stack.sidecar_urls["decode-2"]
    for url, transport, salt in ((shm, "shm", "a"), (tcp, "tcp", "b")):
        before = await _pulled_bytes(session, decode, transport)
        for i, stream in enumerate((False, True)):
            text = f"{salt}{i} cache token prefix block engine gateway replica " * 9
            s1, w1, b1 = await complete(session, agg, text, 10, stream=stream)
            s2, w2, b2 = await complete(session, url, text, 10, stream=stream)
            assert (s1, w1, s2, w2) == (200, "agg-0", 200, "prefill-1,decode-2")
            got = b2["text"] if stream else answer_text(b2)
            want = b1["text"] if stream else answer_text(b1)
            assert got == want
        # Every full prompt page came over this transport (32 KiB per page of 16 tokens).
        assert await _pulled_bytes(session, decode, transport) - before >= 2 * 4 * 32768
    # NIXL asked for: pulled over NIXL where it is installed, else over the TCP stream.
    text = "c0 cache token prefix block engine gateway replica " * 9
    s1, _, b1 = await complete(session, agg, text, 10)
    s2, w2, b2 = await complete(session, nixl, text, 10)
    assert (s1, s2, w2) == (200, 200, "prefill-1,decode-2")
    assert answer_text(b2) == answer_text(b1)
