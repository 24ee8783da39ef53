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
from kvsidecar.local_stack import DEFAULT_MODEL, EngineSpec, LocalStack, StackSpec
from tests.support.polling import eventually
from tests.support.stacks import gateway_process, own_gateways

MODEL = DEFAULT_MODEL


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One reference engine (pages of 16 tokens) and its sidecar, shared by the tests."""
    spec = StackSpec(engines=(EngineSpec(worker_ids=("r0",)),), gateways=(), speedup=20)
    with LocalStack(spec, tmp_path_factory.mktemp("parity")) as stack:
        yield stack


@pytest.fixture
def stack(engine: LocalStack) -> Iterator[LocalStack]:
    """The module's engine and sidecar; the gateways a test starts are stopped after it."""
    with own_gateways(engine) as stack:
        yield stack


def _gateway(stack: LocalStack, model: Path, *flags: str) -> ManagedProcess:
    return gateway_process(stack, "gateway", "--served-model-name", "tiny", *flags,
                           model_path=model)


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
    stack: LocalStack, session: aiohttp.ClientSession
) -> None:
    """Same template, tokenizer and page size: the canary agrees and the worker is exact."""
    gw = _gateway(stack, MODEL)
    worker = await _verdict(session, gw.url, "exact")
    assert worker["parity_reason"] == ""
    async with session.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    assert 'kvsidecar_gateway_worker_hash_parity{parity="exact",worker="r0"} 1.0' in text


@pytest.mark.slow
async def test_another_chat_template_is_flagged_loudly(
    tmp_path: Path, stack: LocalStack, session: aiohttp.ClientSession
) -> None:
    """A gateway whose template renders turns differently: degraded, with where it differs,
    and an error in its log."""
    model = tmp_path / "tiny-other-template"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("| trim ", "")  # keeps spaces
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    gw = _gateway(stack, model)
    worker = await _verdict(session, gw.url, "degraded")
    reason = str(worker["parity_reason"])
    assert reason.startswith("template mismatch") and "token " in reason
    assert "hash_parity_lost" in gw.log_path.read_text()


@pytest.mark.slow
async def test_another_block_size_falls_back_and_says_why(
    stack: LocalStack, session: aiohttp.ClientSession
) -> None:
    """A gateway hashing 32-token blocks against 16-token pages: its stream is refused and the
    worker falls back to load, with the page size named."""
    gw = _gateway(stack, MODEL, "--block-size", "32")
    worker = await _verdict(session, gw.url, "falling_back")
    assert "page size mismatch" in str(worker["parity_reason"])
    assert "hash_parity_lost" in gw.log_path.read_text()
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200  # still served, by load
        assert resp.headers["x-kvsidecar-worker"] == "r0"
