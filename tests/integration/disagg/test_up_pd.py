"""``kvsidecar up --prefill N --decode M``: a disaggregated local stack on CPU."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from tests.integration.disagg.pd_stack import complete, routable


@pytest.mark.slow
async def test_up_serves_through_a_prefill_decode_pair(tmp_path: Path) -> None:
    """The stack comes up with both pools and answers through a pair."""
    up = ManagedProcess.start(
        "up",
        ["kvsidecar", "up", "--prefill", "1", "--decode", "1", "--port", "0", "--speedup", "4",
         "--workdir", str(tmp_path / "stack")],
        workdir=tmp_path,
    )
    try:
        url = up.wait_ready(120)[0]["url"]
        async with aiohttp.ClientSession() as session:
            workers = await routable(session, url, 2)
            assert sorted((w["worker_id"], w["role"]) for w in workers) == [
                ("decode-0", "decode"), ("prefill-0", "prefill")]
            status, worker, body = await complete(session, url, "cache token prefix " * 20, 6,
                                                  stream=True)
        assert (status, worker) == (200, "prefill-0,decode-0")
        assert body["usage"]["completion_tokens"] == 6
    finally:
        assert up.stop() == 0
