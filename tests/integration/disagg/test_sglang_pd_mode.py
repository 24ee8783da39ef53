"""SGLang's native PD mode: the gateway pairs the workers, SGLang's engines move the KV.

The reference engine accepts and ignores the bootstrap fields, and it cannot wait for a
bootstrap room, so here both engines are aggregated engines behind sidecars that declare the
prefill and decode roles: what is checked is the gateway's side (one placement per pool, the
same request to both, the decode answer streamed). SGLang's own KV transfer is not exercised.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kvsidecar.local_stack import EngineSpec
from tests.integration.disagg.pd_stack import (
    answer_text,
    complete,
    gateway,
    pd_stack,
    routable,
)
from tests.support.polling import eventually


async def _engine_prompt_tokens(session: aiohttp.ClientSession, url: str, least: int) -> int:
    """The engine's prompt-token counter, once it reaches ``least``."""

    async def counted() -> int:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        line = next(x for x in text.splitlines() if x.startswith("sglang:prompt_tokens_total "))
        value = int(float(line.split()[1]))
        return value if value >= least else 0

    return await eventually(counted, f"{url} to count {least} prompt tokens", 10.0)


@pytest.mark.slow
async def test_pair_gets_the_same_request_and_decode_answers(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """--pd-mode sglang sends one request to both workers and streams the decode side."""
    stack = pd_stack(tmp_path, [
        "agg",
        EngineSpec(role="prefill", handoff="none",
                   sidecar_args=("--disaggregation-bootstrap-port", "9123")),
        EngineSpec(role="decode", handoff="none"),
    ])
    try:
        native = gateway(stack, "gateway-sglang", "--pd-mode", "sglang")
        agg = gateway(stack, "gateway-agg", "--pd-mode", "off")
        await routable(session, native, 3)
        await routable(session, agg, 3)
        text = "cache1 token2 prefix3 block4 engine5 gateway6 " * 8
        _, _, reference = await complete(session, agg, text, 10)
        async with session.get(stack.sidecar_urls["prefill-1"] + "/v1/kvsidecar/pd/info") as r:
            info = await r.json()
        assert (info["role"], info["bootstrap_port"]) == ("prefill", 9123)
        status, worker, body = await complete(session, native, text, 10, stream=True)
        assert (status, worker) == (200, "prefill-1,decode-2")
        assert body["text"] == answer_text(reference)
        assert body["usage"]["completion_tokens"] == 10
        # Both engines were given the whole prompt (the health checks add a token or two).
        want = body["usage"]["prompt_tokens"]
        for worker_id in ("prefill-1", "decode-2"):
            assert await _engine_prompt_tokens(session, stack.engine_urls[worker_id], want) >= want
    finally:
        stack.stop()
