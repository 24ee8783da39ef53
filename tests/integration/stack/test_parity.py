"""Hash parity through real processes: an engine, its sidecar and a gateway that hashes as the
engine caches (exact), one whose chat template differs (degraded), one whose block size
differs (falling back); each verdict with its reason in /v1/workers, /metrics and the log."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from tests.support.polling import eventually
from tests.support.processes import ProcessGroup

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}'


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """One reference engine (pages of 16 tokens) and its sidecar, shared by the tests."""
    tmp = tmp_path_factory.mktemp("parity")
    with ProcessGroup[ManagedProcess]() as group:
        engine = group.add(ManagedProcess.start(
            "engine", ["refengine", "--compute", "sim", "--port", "0", "--speedup", "20",
                       "--kv-events-config", EVENTS], workdir=tmp))
        engine.wait_ready(60)
        sc = group.add(ManagedProcess.start(
            "sidecar", ["sidecar", "--engine-url", engine.url, "--worker-id", "r0",
                        "--port", "0"], workdir=tmp))
        sc.wait_ready(60)
        yield sc


def _gateway(
    tmp: Path, group: ProcessGroup[ManagedProcess], sidecar_url: str, model: Path, *flags: str
) -> ManagedProcess:
    gw = group.add(ManagedProcess.start(
        "gateway", ["routing", "--port", "0", "--sidecar", sidecar_url, "--model-path",
                    str(model), "--served-model-name", "tiny", *flags], workdir=tmp))
    gw.wait_ready(60)
    return gw


async def _verdict(session: aiohttp.ClientSession, url: str, parity: str) -> dict[str, object]:
    async def worker() -> dict[str, object] | None:
        async with session.get(f"{url}/v1/workers") as resp:
            workers = (await resp.json())["workers"]
        assert len(workers) <= 1, workers
        # none yet: the gateway may answer before its first discovery of the sidecar
        return workers[0] if workers and workers[0]["parity"] == parity else None

    found: dict[str, object] = await eventually(worker, f"the worker to be {parity}", 30)
    return found


@pytest.mark.slow
async def test_a_gateway_that_hashes_as_the_engine_is_exact(
    tmp_path: Path, sidecar: ManagedProcess, session: aiohttp.ClientSession
) -> None:
    """Same template, tokenizer and page size: the canary agrees and the worker is exact."""
    with ProcessGroup[ManagedProcess]() as group:
        gw = _gateway(tmp_path, group, sidecar.url, MODEL)
        worker = await _verdict(session, gw.url, "exact")
        assert worker["parity_reason"] == ""
        async with session.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()
        assert 'kvsidecar_gateway_worker_hash_parity{parity="exact",worker="r0"} 1.0' in text


@pytest.mark.slow
async def test_another_chat_template_is_flagged_loudly(
    tmp_path: Path, sidecar: ManagedProcess, session: aiohttp.ClientSession
) -> None:
    """A gateway whose template renders turns differently: degraded, with where it differs,
    and an error in its log."""
    model = tmp_path / "tiny-other-template"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("| trim ", "")  # keeps spaces
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with ProcessGroup[ManagedProcess]() as group:
        gw = _gateway(tmp_path, group, sidecar.url, model)
        worker = await _verdict(session, gw.url, "degraded")
        reason = str(worker["parity_reason"])
        assert reason.startswith("template mismatch") and "token " in reason
        assert "hash_parity_lost" in gw.log_path.read_text()


@pytest.mark.slow
async def test_another_block_size_falls_back_and_says_why(
    tmp_path: Path, sidecar: ManagedProcess, session: aiohttp.ClientSession
) -> None:
    """A gateway hashing 32-token blocks against 16-token pages: its stream is refused and the
    worker falls back to load, with the page size named."""
    with ProcessGroup[ManagedProcess]() as group:
        gw = _gateway(tmp_path, group, sidecar.url, MODEL, "--block-size", "32")
        worker = await _verdict(session, gw.url, "falling_back")
        assert "page size mismatch" in str(worker["parity_reason"])
        assert "hash_parity_lost" in gw.log_path.read_text()
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200  # still served, by load
            assert resp.headers["x-kvsidecar-worker"] == "r0"
