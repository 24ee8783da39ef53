"""The gateway's disaggregation settings, pool filter, decode reservations and metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvcore.stream import WorkerStatus
from routing.config import RouterConfig, WorkerAddress
from routing.flags import gateway_config
from routing.pd.coordinator import (
    DEFAULT_RESERVE_TOKENS,
    FailurePolicy,
    PdCoordinator,
    PdMode,
    PdPair,
)
from routing.pipeline.pair import _error_of
from routing.placement.kv_router import KvRouter
from routing.placement.refusal import Refusal
from routing.prompt.preparer import PreparedPrompt
from routing.serve.gateway import Gateway
from routing.workers.registry import Role, Worker, WorkerKind, WorkerRegistry
from tests.support.polling import wait_for

MODEL = Path(__file__).resolve().parents[4] / "refengine" / "models" / "tiny"
SIDECAR = "http://127.0.0.1:9"


def _config(*flags: str) -> RouterConfig:
    return gateway_config(["--sidecar", SIDECAR, "--model-path", str(MODEL), *flags])


class TestConfig:
    def test_defaults_are_auto_and_fallback(self) -> None:
        """Without flags the gateway pairs prefill/decode workers and falls back on failure."""
        cfg = _config()
        assert PdMode(cfg.pd_mode) is PdMode.AUTO
        assert FailurePolicy(cfg.kv_load_failure_policy) is FailurePolicy.FALLBACK
        assert (cfg.kv_transfer_timeout_s, cfg.pd_queue_timeout_s) == (10.0, 30.0)

    def test_flags_map_to_fields(self) -> None:
        """Each disaggregation flag lands in its field."""
        cfg = _config("--pd-mode", "sglang", "--kv-load-failure-policy", "fail",
                      "--kv-transfer-timeout-s", "2.5", "--pd-queue-timeout-s", "0")
        assert (cfg.pd_mode, cfg.kv_load_failure_policy) == ("sglang", "fail")
        assert (cfg.kv_transfer_timeout_s, cfg.pd_queue_timeout_s) == (2.5, 0.0)

    @pytest.mark.parametrize(
        ("field", "value", "message"),
        [
            ("pd_mode", "both", "pd_mode must be auto, sglang or off"),
            ("kv_load_failure_policy", "retry", "kv_load_failure_policy must be fail or fallback"),
            ("kv_transfer_timeout_s", -1.0, "kv_transfer_timeout_s must be a finite number"),
            ("pd_queue_timeout_s", float("nan"), "pd_queue_timeout_s must be a finite number"),
        ],
    )
    def test_bad_values_are_refused(self, field: str, value: object, message: str) -> None:
        """A bad disaggregation setting fails at construction with a message naming it."""
        from routing.config import WorkerAddress

        with pytest.raises(ValueError, match=message):
            RouterConfig(workers=(), sidecars=(WorkerAddress.parse(SIDECAR),), model_path=MODEL,
                         **{field: value})  # type: ignore[arg-type]


class TestCoordinator:
    async def test_reservation_covers_prompt_and_output(self) -> None:
        """A decode reservation is the prompt plus max_tokens (a default without), in blocks."""
        gw = Gateway(_config())
        assert gw.pd is not None
        assert gw.pd.reserve_blocks(100, 60) == 10  # ceil(160 / 16)
        assert gw.pd.reserve_blocks(16, 0) == 1
        assert gw.pd.reserve_blocks(0, None) == DEFAULT_RESERVE_TOKENS // 16

    async def test_no_roles_means_every_worker_is_aggregated(self) -> None:
        """Before any sidecar declares a role, aggregated placement sees every worker."""
        gw = Gateway(_config())
        assert gw.pd is not None
        plain = [Worker(f"w{i}", WorkerAddress.parse(f"http://127.0.0.1:{9 + i}")) for i in (0, 1)]
        for worker in plain:
            gw.workers.add(worker)
        assert not gw.workers.has_roles()
        assert gw.workers.routable(Role.AGG) == plain
        assert gw.workers.routable(Role.PREFILL) == [] and gw.workers.routable(Role.DECODE) == []

    async def test_metrics_are_exported_with_the_gateways(self) -> None:
        """The disaggregation counters render on the gateway's /metrics, with their labels."""
        gw = Gateway(_config())
        assert gw.pd is not None
        gw.pd.metrics.transfer_failures["fail"] += 2
        gw.pd.metrics.fallbacks["rerun"] += 1
        text = gw.metrics.render().decode()
        assert 'kvsidecar_gateway_kv_transfer_failures_total{policy="fail"} 2.0' in text
        assert 'kvsidecar_gateway_pd_fallbacks_total{outcome="rerun"} 1.0' in text
        assert "kvsidecar_gateway_pd_waiting 0.0" in text
        await asyncio.sleep(0)

    def test_gateway_without_sidecars_has_no_coordinator(self) -> None:
        """Plain workers only: nothing of disaggregation is set up."""
        cfg = gateway_config(["--worker", "http://127.0.0.1:9"])
        assert Gateway(cfg).pd is None


class TestSidecarErrors:
    def test_transfer_failure_code_and_message_are_read(self) -> None:
        """The sidecar's OpenAI-shaped error yields its code and message."""
        raw = b'{"error":{"message":"KV transfer failed: x","type":"bad_gateway",' \
              b'"param":null,"code":"kv_transfer_failed"}}'
        error = _error_of(raw)
        assert error["code"] == "kv_transfer_failed"
        assert error["message"] == "KV transfer failed: x"

    def test_non_json_error_has_no_code(self) -> None:
        """A non-JSON error body has no code (the exchange relays it as it came)."""
        assert _error_of(b"<html>oops</html>") == {}


def _pd(queue_timeout_s: float = 5.0) -> tuple[PdCoordinator, WorkerRegistry]:
    router = KvRouter(block_size=16)
    registry = WorkerRegistry(on_capacity=router.load.set_capacity)
    for worker_id, role, port in (("p", "prefill", 9001), ("d", "decode", 9002)):
        address = WorkerAddress.parse(f"http://127.0.0.1:{port}")
        registry.add(Worker(worker_id, address, WorkerKind.SIDECAR, dp_rank=0,
                            bootstrap=("10.0.0.1", 8998) if role == "prefill" else None))
        registry.stream_up(worker_id, role)
    registry.reported(WorkerStatus("p", 1, True, "", "prefill"))
    registry.reported(WorkerStatus("d", 1, True, "", "decode", 20))  # 20 blocks of KV
    pd = PdCoordinator(router, registry, mode=PdMode.AUTO, policy=FailurePolicy.FALLBACK,
                       queue_timeout_s=queue_timeout_s, transfer_timeout_s=3.0,
                       kv_transport="auto")
    return pd, registry


def _prompt(tokens: int) -> PreparedPrompt:
    return PreparedPrompt([], tokens, None, True, token_ids=list(range(tokens)))


class TestPairPlacement:
    async def test_a_pair_reserves_decode_room_until_released(self) -> None:
        """A pair holds prompt + max_tokens of the decode worker's capacity; a request that
        no longer fits waits, and gets room when the first is released."""
        pd, _ = _pd()
        assert pd.takes(_prompt(160))
        first = pd.place(_prompt(160), 64)  # 14 of 20 blocks
        assert isinstance(first, PdPair) and (first.prefill.worker_id, first.decode.worker_id) \
            == ("p", "d")
        full = pd.place(_prompt(160), 64)
        assert isinstance(full, Refusal) and full.busy
        waiter = asyncio.ensure_future(pd.place_waiting(_prompt(160), 64))
        await wait_for(lambda: pd.metrics.waiting == 1, "the request to wait")
        pd.release(first)
        second = await waiter
        assert isinstance(second, PdPair)
        assert (pd.metrics.backpressure_waits, pd.metrics.waiting) == (1, 0)

    async def test_waiting_ends_in_a_clear_refusal(self) -> None:
        """No room within --pd-queue-timeout-s: a reason the client gets with its 503."""
        pd, _ = _pd(queue_timeout_s=0.05)
        assert isinstance(pd.place(_prompt(160), 64), PdPair)
        refused = await pd.place_waiting(_prompt(160), 64)
        assert refused == Refusal(503, "every decode worker is full (the request needs 14 KV "
                                  "blocks); waited 0.05s, retry later", "service_unavailable",
                                  retry_after_s=1)
        assert pd.metrics.backpressure_rejects == 1

    def test_a_request_larger_than_any_decode_worker_is_refused_at_once(self) -> None:
        """Waiting cannot help a request that needs more blocks than any worker has."""
        pd, _ = _pd()
        refused = pd.place(_prompt(1000), 64)
        assert isinstance(refused, Refusal) and not refused.busy
        assert (refused.status, refused.retry_after_s) == (503, 1)
        assert "no decode worker has that many" in refused.message

    def test_how_the_pair_shares_the_kv(self) -> None:
        """One host: the handoff goes over shm; a bootstrap pair shares one room."""
        pd, _ = _pd()
        pair = pd.place(_prompt(32), 8)
        assert isinstance(pair, PdPair)
        handoff = pd.handoff(pair)
        assert (handoff.prefill_url, handoff.transport) == ("http://127.0.0.1:9001", "shm")
        assert handoff.early_first_token is False  # the fallback policy waits on the outcome
        legs = pd.bootstrap(pair)
        assert not isinstance(legs, Refusal)
        prefill, decode = legs
        assert (prefill.role, decode.role, prefill.host, prefill.port) == (
            "prefill", "decode", "10.0.0.1", 8998)
        assert prefill.room == decode.room
