"""The engine's own load, from SGLang's real load publisher to the gateway (the `sglang` extra).

SGLang's ``SchedulerLoadPublisher`` runs in the test with its own gating, encoding, framing
and socket options; only its bind is moved to an ephemeral port (its ``_open_pub_socket``,
the one side effect SGLang's own tests stub). A reference engine answers the sidecar's HTTP
side and publishes its KV events; the sidecar (a real process, ``--load-endpoint``) reads the
load socket and reports it on its status; a real gateway shows it in ``/v1/workers`` and
``/metrics`` as the worker's load source, and goes back to its own count once the engine's
readings stop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

load_publisher = pytest.importorskip("sglang.srt.managers.scheduler_components.load_publisher")

from sglang.srt.managers.load_snapshot import LoadSnapshot  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from kvsidecar.local_stack import (  # noqa: E402
    EngineSpec,
    ExternalPublisher,
    GatewaySpec,
    LocalStack,
    StackSpec,
)
from tests.support.polling import eventually  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
SNAPSHOT = LoadSnapshot(
    num_running_reqs=3,
    num_waiting_reqs=2,
    num_waiting_uncached_tokens=640,
    num_used_tokens=1184,
    max_total_num_tokens=20480,
)


def sglang_load_publisher(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str]:
    """SGLang's publisher for DP rank 0 of one scheduler, bound to an ephemeral port."""
    bound: list[str] = []
    open_socket = load_publisher._open_pub_socket

    def open_ephemeral(endpoint: str) -> zmq.Socket:
        sock = open_socket("tcp://127.0.0.1:*")  # instead of the derived (fixed) port
        bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return sock

    monkeypatch.setattr(load_publisher, "_open_pub_socket", open_ephemeral)
    kv_events = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557"})
    with get_parallel().override(
        pp_rank=0,
        attn_tp_rank=0,
        attn_cp_rank=0,
        num_dp_ranks=1,
        attn_dp_size=1,
        attn_dp_rank=0,
        dp_rank=0,
    ):
        pub = load_publisher.SchedulerLoadPublisher(
            kv_events_config=kv_events, load_publish_endpoint="auto"
        )
    assert pub.enable, "SGLang's load publisher did not bind"
    return pub, bound[0]


async def worker_view(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/workers") as resp:
        (worker,) = (await resp.json())["workers"]
    return dict(worker)


async def test_gateway_shows_and_places_by_the_engines_own_load(
    tmp_path: Path, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's reading reaches /v1/workers and /metrics as the load source, its surplus is
    the worker's load, and a publisher that goes silent hands the load back to the gateway."""
    pub, endpoint = sglang_load_publisher(monkeypatch)
    try:
        spec = StackSpec(
            engines=(EngineSpec(worker_ids=("sg",), publisher=ExternalPublisher(load=endpoint)),),
            gateways=(GatewaySpec(args=("--served-model-name", "tiny"), wait_routable=False),))
        async with LocalStack(spec, tmp_path) as stack:
            gateway, sidecar = stack.url, stack.sidecar_urls["sg"]
            async def engine_sourced() -> dict[str, Any] | None:
                # SGLang's own publish path; it re-sends an unchanged reading once a second,
                # so this also covers the subscriber joining after the first one.
                pub.publish_load_stat(lambda: SNAPSHOT, force=True)
                worker = await worker_view(session, gateway)
                return worker if worker["load_source"] == "engine" else None

            worker = await eventually(
                engine_sourced, "the engine's load at the gateway", 30, interval_s=0.1
            )
            reading = worker["engine_load"]
            assert (reading["running"], reading["queued"]) == (3, 2)
            assert (reading["kv_used_tokens"], reading["kv_capacity_tokens"]) == (1184, 20480)
            assert reading["queued_prefill_tokens"] == 640
            assert reading["kv_usage"] == pytest.approx(1184 / 20480, abs=1e-4)
            # The gateway sent nothing: all of the engine's load is surplus over its count.
            assert worker["in_flight"] == 5
            assert worker["active_prefill_tokens"] == 640
            assert worker["active_blocks"] == 1184 // 16

            async with session.get(f"{gateway}/metrics") as resp:
                metrics = await resp.text()
            assert 'kvsidecar_gateway_worker_load_source{source="engine",worker="sg"} 1.0' in (
                metrics
            )
            assert 'kvsidecar_gateway_worker_engine_running{worker="sg"} 3.0' in metrics
            async with session.get(f"{sidecar}/v1/load") as resp:
                assert (await resp.json())["sg"]["load_source"] == "engine"
            async with session.get(f"{sidecar}/metrics") as resp:
                sample = "kvsidecar_adapter_engine_load_readings_total"
                assert f'{sample}{{engine="sglang",worker="sg"}}' in await resp.text()

            pub.close()  # the scheduler is gone: its last reading goes stale

            async def gateway_sourced() -> dict[str, Any] | None:
                worker = await worker_view(session, gateway)
                return worker if worker["load_source"] == "gateway" else None

            worker = await eventually(gateway_sourced, "the gateway's own count again", 30, 0.1)
            assert worker["engine_load"] is None and worker["in_flight"] == 0
    finally:
        pub.close()
