"""An engine started with --api-key: the sidecar sends its key, never logs it, and says
clearly when it has none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import LaunchError, ManagedProcess
from tests.support.processes import ProcessGroup

KEY = "sk-engine-7f3a9c"
EVENTS = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}'


@pytest.fixture
def started() -> Iterator[ProcessGroup[ManagedProcess]]:
    with ProcessGroup[ManagedProcess]() as group:
        yield group


def _engine(tmp: Path, group: ProcessGroup[ManagedProcess]) -> ManagedProcess:
    proc = group.add(ManagedProcess.start(
        "engine",
        ["refengine", "--compute", "sim", "--port", "0", "--speedup", "20",
         "--kv-events-config", EVENTS, "--api-key", KEY],
        workdir=tmp,
    ))
    proc.wait_ready(60)
    return proc


def _sidecar(
    tmp: Path, group: ProcessGroup[ManagedProcess], engine_url: str, *extra: str
) -> ManagedProcess:
    return group.add(ManagedProcess.start(
        "sidecar",
        ["sidecar", "--engine-url", engine_url, "--worker-id", "r0", "--port", "0", *extra],
        workdir=tmp,
    ))


@pytest.mark.slow
async def test_the_sidecar_serves_an_engine_that_wants_a_key(
    tmp_path: Path, started: ProcessGroup[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """With --engine-api-key-file requests and discovery succeed; the key is in no log line."""
    engine = _engine(tmp_path, started)
    async with session.post(f"{engine.url}/generate", json={"input_ids": [1, 2]}) as resp:
        assert resp.status == 401  # the engine really refuses a request without its key
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    sidecar = _sidecar(tmp_path, started, engine.url, "--engine-api-key-file", str(key_file),
                       "--log-level", "debug")
    sidecar.wait_ready(60)
    body = {"request_id": "k1", "model": "tiny", "kind": "completion",
            "prompt_token_ids": list(range(10, 42)), "max_tokens": 3}
    async with session.post(f"{sidecar.url}/v1/kvsidecar/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["usage"]["completion_tokens"] == 3
    assert sidecar.stop() == 0
    assert KEY not in sidecar.log_path.read_text()


@pytest.mark.slow  # real processes, seconds a test
def test_without_its_key_the_sidecar_says_what_is_missing(
    tmp_path: Path, started: ProcessGroup[ManagedProcess]
) -> None:
    """No key: the sidecar exits at start with a message naming the flag."""
    engine = _engine(tmp_path, started)
    sidecar = _sidecar(tmp_path, started, engine.url)
    with pytest.raises(LaunchError, match="--engine-api-key-file"):
        sidecar.wait_ready(60)
