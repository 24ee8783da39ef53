"""The parity checker's judgements that need no engine: token lists, the engines' reports of
cached tokens, workers it cannot verify, and a refused stream."""

from __future__ import annotations

import aiohttp

from kvcore import BlockHasher
from routing.config import WorkerAddress
from routing.metrics import GatewayMetrics
from routing.prompt.preparer import PromptPreparer
from routing.workers.parity import ParityChecker, first_difference
from routing.workers.registry import Health, Parity, Worker, WorkerKind, WorkerRegistry

ADDRESS = WorkerAddress.parse("http://127.0.0.1:9")


def test_first_difference_names_where_and_what() -> None:
    """Equal lists agree; otherwise the first differing token, or the lengths."""
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == "token 1: gateway 2, engine 5"
    assert first_difference([1, 2], [1, 2, 3]) == "gateway 2 tokens, engine 3"


async def test_what_cannot_be_verified_says_so() -> None:
    """A plain engine, and a gateway without a tokenizer, are unverified, with the reason."""
    registry = WorkerRegistry(on_capacity=lambda w, c: None)
    plain = Worker("p", ADDRESS)
    sidecar = Worker("s", ADDRESS, WorkerKind.SIDECAR)
    registry.add(plain)
    registry.add(sidecar)
    prompts = PromptPreparer(None, None, BlockHasher(16), hash_prompts=True, max_model_len=None)
    async with aiohttp.ClientSession() as session:
        checker = ParityChecker(registry, prompts, GatewayMetrics(), session, model_id="m")
        await checker.check_all()
    assert plain.parity is Parity.UNVERIFIED and "plain engine" in plain.parity_reason
    assert sidecar.parity is Parity.UNVERIFIED and "pseudo-tokens" in sidecar.parity_reason


async def test_a_refused_stream_falls_back_to_load() -> None:
    """A stream refused for a page size mismatch: still routable, flagged falling back."""
    checked: list[str] = []
    registry = WorkerRegistry(on_capacity=lambda w, c: None)
    registry.check_parity = lambda worker: checked.append(worker.worker_id)
    worker = Worker("s", ADDRESS, WorkerKind.SIDECAR)
    registry.add(worker)
    assert worker.health is Health.STREAM_DOWN
    registry.mismatched("s", "page size mismatch: 32 != 16")
    assert worker.health is Health.ROUTABLE and registry.routable() == [worker]
    assert checked == ["s"]
    prompts = PromptPreparer(None, None, BlockHasher(16), hash_prompts=True, max_model_len=None)
    async with aiohttp.ClientSession() as session:
        checker = ParityChecker(registry, prompts, GatewayMetrics(), session, model_id="m")
        await checker.check(worker)
    assert worker.parity is Parity.FALLING_BACK and "page size" in worker.parity_reason


def test_far_fewer_reported_cached_tokens_degrade_a_worker() -> None:
    """Since the last check: a fair share of the prediction reported is fine; far less is
    a sign the engine keys its cache otherwise."""
    metrics = GatewayMetrics()
    checker = ParityChecker(WorkerRegistry(on_capacity=lambda w, c: None), None,  # type: ignore[arg-type]
                            metrics, None, model_id="m")  # type: ignore[arg-type]
    metrics.worker_predicted_cached_tokens["w"] = 1000
    assert checker._reports_short("w") is None  # too few predicted to judge
    metrics.worker_predicted_cached_tokens["w"] = 9000
    metrics.worker_actual_cached_tokens["w"] = 6000
    assert checker._reports_short("w") is None
    metrics.worker_predicted_cached_tokens["w"] = 17000
    metrics.worker_actual_cached_tokens["w"] = 6500
    short = checker._reports_short("w")
    assert short is not None and "reported 500 cached tokens where 8000 were predicted" in short
