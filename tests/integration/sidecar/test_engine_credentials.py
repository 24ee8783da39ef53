"""An engine started with --api-key: the sidecar sends its key, never logs it, and says
clearly when it has none."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import LaunchError, ManagedProcess
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec

KEY = "sk-engine-7f3a9c"


def _spec(*sidecar_args: str) -> StackSpec:
    """An engine that wants ``KEY`` (simulated compute) and its sidecar ``r0``."""
    return StackSpec(engines=(EngineSpec(worker_ids=("r0",), args=("--api-key", KEY),
                                         sidecar_args=sidecar_args),), gateways=(), speedup=20)


@pytest.mark.slow
async def test_the_sidecar_serves_an_engine_that_wants_a_key(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """With --engine-api-key-file requests and discovery succeed; the key is in no log line."""
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    spec = _spec("--engine-api-key-file", str(key_file), "--log-level", "debug")
    async with LocalStack(spec, tmp_path) as stack:
        engine, sidecar = stack.engine_urls["r0"], stack.sidecars[0]
        async with session.post(f"{engine}/generate", json={"input_ids": [1, 2]}) as resp:
            assert resp.status == 401  # the engine really refuses a request without its key
        body = {"request_id": "k1", "model": "tiny", "kind": "completion",
                "prompt_token_ids": list(range(10, 42)), "max_tokens": 3}
        async with session.post(f"{sidecar.url}/v1/kvsidecar/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        assert isinstance(sidecar.proc, ManagedProcess)
        assert stack.stop_child(sidecar.proc) == 0
        assert KEY not in sidecar.proc.log_path.read_text()


@pytest.mark.slow  # real processes, seconds a test
def test_without_its_key_the_sidecar_says_what_is_missing(tmp_path: Path) -> None:
    """No key: the sidecar exits at start with a message naming the flag."""
    with pytest.raises(LaunchError, match="--engine-api-key-file"), LocalStack(_spec(), tmp_path):
        pass  # not reached: the stack does not start
