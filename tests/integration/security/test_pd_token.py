"""A prefill/decode pair whose sidecars want a control token: the gateway's legs and the
decode sidecar's pull from the prefill sidecar's block export both carry it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvcore.control_token import CONTROL_TOKEN_HEADER
from kvsidecar.local_stack import EngineSpec, LocalStack
from tests.integration.disagg.pd_stack import complete, gateway, pd_stack, routable
from tests.support.polling import eventually

TOKEN = "ctl-pd-51c0"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    guarded = ("--control-token-file", str(token))
    s = pd_stack(tmp_path, [EngineSpec(role=role, handoff="sidecar", sidecar_args=guarded)
                            for role in ("prefill", "decode")], compute="torch")
    try:
        yield s
    finally:
        s.stop()


async def _pulled_bytes(session: aiohttp.ClientSession, sidecar: str) -> float:
    async with session.get(f"{sidecar}/metrics") as resp:  # /metrics needs no token
        text = await resp.text()
    name = 'kvsidecar_transfer_bytes_total{outcome="ok",transport="tcp"} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.slow
async def test_a_pd_pair_behind_control_tokens_hands_its_kv_over(
    stack: LocalStack, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    url = gateway(stack, "gateway", "--kv-load-failure-policy", "fail", "--kv-transport",
                  "tcp", "--sidecar-token-file", str(tmp_path / "token"))
    await routable(session, url, 2)
    decode = stack.sidecar_urls["decode-1"]
    attempts = iter(range(1, 1 << 30))

    async def handed_over() -> bool:
        # The engines' hooks attach to their stores a moment after start: retry until then.
        text = f"guarded {next(attempts)} cache token prefix block engine gateway " * 9
        status, worker, body = await complete(session, url, text, 6)
        assert status in (200, 502), body
        assert status == 200 or body["error"]["code"] == "kv_transfer_failed", body
        return status == 200 and worker == "prefill-0,decode-1"

    await eventually(handed_over, "a request served by the pair", 60, 0.1)
    assert await _pulled_bytes(session, decode) > 0  # pulled from the guarded export
    prefill = stack.sidecar_urls["prefill-0"]
    async with session.get(f"{prefill}/v1/blocks/info") as resp:
        assert resp.status == 401
    async with session.get(f"{prefill}/v1/blocks/info",
                           headers={CONTROL_TOKEN_HEADER: TOKEN}) as resp:
        assert resp.status == 200
