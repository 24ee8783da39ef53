"""SGLang's scheduler load socket: decoding its messages, the board of readings, discovery.

The fixtures are SGLang 0.5.23's own bytes: ``LOAD_STAT_FULL`` and ``LOAD_STAT_RANK1`` are
what its ``load_publisher._encoder`` makes of ``LoadStat(3, 2, 1184, 20480, 0, 640, 1824, 48,
90112, 5200000)`` and ``LoadStat(0, 0, 0, 0, 1)``, and ``KV_EVENTS_WITH_LOAD`` is what its
``describe_kv_events_publisher`` answers for ``--kv-events-config`` on ``tcp://*:5557`` (replay
5558), ``--load-publish-endpoint auto``, ``--dp-size 2`` (the load range packs after the
replay range). ``test_fixtures_are_sglangs_own`` re-derives them when SGLang is installed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from structlog.testing import capture_logs

from adapters.base import AdapterConfig, AdapterError, EngineAdapter, EngineKind, EventEndpoint
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.adapter import SGLangAdapter, load_endpoints_from_server_info
from adapters.sglang.load_feed import LoadBoard
from adapters.sglang.load_wire import LoadStat, decode_load, to_engine_load
from adapters.sglang.wire import FrameError
from adapters.trtllm.adapter import TrtllmAdapter
from kvcore.stream import EngineLoad
from sidecar.config import SidecarConfig
from tests.support.polling import eventually
from tests.unit.adapters.fake_adapter import FakeAdapter
from tests.unit.adapters.fake_engines import FakeSGLangPublisher

LOAD_STAT_FULL = bytes.fromhex(
    "9ba84c6f6164537461740302cd04a0cd500000cd0280cd072030ce00016000ce004f5880"
)
LOAD_STAT_RANK1 = bytes.fromhex("9ba84c6f61645374617400000000010000000000")
KV_EVENTS_WITH_LOAD = {
    "publisher": "zmq",
    "endpoint_host": "*",
    "endpoint_port_base": 5557,
    "topic": "",
    "block_size": 16,
    "dp_size": 2,
    "load_endpoint_port_base": 5560,
    "load_topic": "load",
    "replay_endpoint_port_base": 5558,
}
SEQ7 = (7).to_bytes(8, "big")


def frames(payload: bytes, seq: bytes = SEQ7) -> list[bytes]:
    return [b"load", seq, payload]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the wire format ---------------------------------------------------------------------


def test_recorded_load_stat_decodes_field_for_field() -> None:
    """SGLang's bytes decode into every LoadStat field, and map onto the canonical reading."""
    seq, stat = decode_load(frames(LOAD_STAT_FULL))
    assert seq == 7
    assert stat == LoadStat(3, 2, 1184, 20480, 0, 640, 1824, 48, 90112, 5200000)
    assert to_engine_load(stat) == EngineLoad(
        running=3,
        queued=2,
        kv_used_tokens=1184,
        kv_capacity_tokens=20480,
        queued_prefill_tokens=640,
    )
    assert to_engine_load(stat).kv_usage == pytest.approx(1184 / 20480)
    _, idle = decode_load(frames(LOAD_STAT_RANK1))
    assert idle.attn_dp_rank == 1
    assert to_engine_load(idle).kv_capacity_tokens is None  # 0: SGLang does not know


def test_older_and_newer_shapes_decode() -> None:
    """The stable six-field prefix alone decodes; fields a newer SGLang appends are ignored."""
    old = msgspec.msgpack.encode(["LoadStat", 1, 0, 32, 64, 0])
    assert decode_load(frames(old))[1] == LoadStat(1, 0, 32, 64, 0)
    newer = msgspec.msgpack.encode(["LoadStat", 1, 0, 32, 64, 0, 5, 6, 7, 8, 9, 10, "x"])
    assert decode_load(frames(newer))[1].total_prefill_busy_us == 9


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ([b"load", SEQ7], "3 frames"),
        ([b"load", b"\x00" * 4, LOAD_STAT_FULL], "sequence frame"),
        (frames(b"\xc1"), "not an SGLang LoadStat"),
        (frames(LOAD_STAT_FULL[:-3]), "not an SGLang LoadStat"),
        (frames(msgspec.msgpack.encode(["LoadStat", 1, 2, 3])), "at least length"),
        (frames(msgspec.msgpack.encode(["KVEventBatch", 1, 2, 3, 4])), "Invalid value"),
        (frames(msgspec.msgpack.encode(["LoadStat", -1, 2, 3, 4])), ">= 0"),
        (frames(msgspec.msgpack.encode(["LoadStat", True, 2, 3, 4])), "got `bool`"),
        (frames(msgspec.msgpack.encode(["LoadStat", 1.5, 2, 3, 4])), "got `float`"),
        (frames(msgspec.msgpack.encode({"num_running_reqs": 1})), "Expected `array`"),
    ],
)
def test_corrupt_messages_raise_frame_error(message: list[bytes], match: str) -> None:
    """Anything but SGLang's framing and LoadStat is a FrameError saying what was wrong."""
    with pytest.raises(FrameError, match=match):
        decode_load(message)


# --- the board ------------------------------------------------------------------------------


def test_board_keeps_the_newest_reading_until_it_goes_stale() -> None:
    """Readings replace each other; age is reported; a silent socket stops being answered."""
    clock = Clock()
    metrics = AdapterMetrics("sglang")
    board = LoadBoard(metrics, stale_after_s=5.0, clock=clock)
    assert board.get("w") is None
    assert board.receive("w", frames(LOAD_STAT_RANK1))
    assert board.receive("w", frames(LOAD_STAT_FULL))
    clock.now += 1.25
    reading = board.get("w")
    assert reading is not None and reading.running == 3 and reading.age_ms == 1250
    assert board.get("other") is None
    clock.now += 4.0
    assert board.get("w") is None
    assert metrics.value("engine_load_readings", worker="w") == 2


def test_corrupt_message_is_counted_logged_and_loses_nothing() -> None:
    """A corrupt message is counted and logged (throttled), and the last good reading stays."""
    clock = Clock()
    metrics = AdapterMetrics("sglang")
    board = LoadBoard(metrics, clock=clock)
    board.receive("w", frames(LOAD_STAT_FULL))
    with capture_logs() as logs:
        for _ in range(3):
            assert not board.receive("w", frames(b"\x93garbage"))
        clock.now += 11.0
        assert not board.receive("w", [b"load"])
        assert board.receive("w", frames(LOAD_STAT_FULL))
    failed = [e for e in logs if e["event"] == "engine_load_decode_failed"]
    assert [e["not_logged_before"] for e in failed] == [0, 2]
    assert failed[0]["worker_id"] == "w" and failed[0]["raw_len"] > 0
    assert failed[0]["log_level"] == "error"
    assert metrics.value("decode_errors", worker="w", kind="load") == 4
    reading = board.get("w")
    assert reading is not None and reading.queued == 2


# --- discovery ------------------------------------------------------------------------------


def test_load_endpoints_from_server_info() -> None:
    """One load socket per DP rank at base + rank, on the engine URL's host, with its topic."""
    info = {"kv_events": KV_EVENTS_WITH_LOAD}
    assert load_endpoints_from_server_info(info, "http://10.0.0.7:30000") == (
        EventEndpoint(0, "tcp://10.0.0.7:5560", topic="load"),
        EventEndpoint(1, "tcp://10.0.0.7:5561", topic="load"),
    )
    concrete = KV_EVENTS_WITH_LOAD | {"endpoint_host": "10.9.9.9", "dp_size": 1}
    (ep,) = load_endpoints_from_server_info({"kv_events": concrete}, "http://[::1]:30000")
    assert ep.endpoint == "tcp://[::1]:5560"  # SGLang binds load on a wildcard, always
    without = {k: v for k, v in KV_EVENTS_WITH_LOAD.items() if not k.startswith("load_")}
    assert load_endpoints_from_server_info({"kv_events": without}, "http://h:1") == ()
    assert load_endpoints_from_server_info({}, "http://h:1") == ()


@pytest.mark.parametrize("base", ["x", 0, 65535 + 1, 65535])
def test_malformed_load_range_is_a_clear_error(base: Any) -> None:
    """A load port range that is not one (or runs past 65535) fails discovery loudly."""
    kv = KV_EVENTS_WITH_LOAD | {"load_endpoint_port_base": base}
    with pytest.raises(AdapterError, match="malformed"):
        load_endpoints_from_server_info({"kv_events": kv}, "http://h:1")


# --- the adapter, end to end on loopback -------------------------------------------------


@pytest.fixture
async def load_pub() -> AsyncIterator[zmq.asyncio.Socket]:
    """A PUB socket on an ephemeral port standing in for SGLang's load socket."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    try:
        yield pub
    finally:
        pub.close(linger=0)
        ctx.term()


async def serve_info(info: dict[str, Any]) -> tuple[web.AppRunner, str]:
    """A fake SGLang HTTP front (engine boundary) answering /server_info."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(info)

    app = web.Application()
    app.router.add_get("/server_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_adapter_discovers_and_reads_the_load_socket(load_pub: zmq.asyncio.Socket) -> None:
    """/server_info's load range is subscribed; readings reach engine_load; a corrupt one
    is counted and the reading before it stays."""
    engine = FakeSGLangPublisher(block_size=16)
    port = int(load_pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    kv_port = int(engine.endpoint.rsplit(":", 1)[1])
    kv = KV_EVENTS_WITH_LOAD | {
        "endpoint_host": "127.0.0.1",
        "endpoint_port_base": kv_port,
        "dp_size": 1,
        "load_endpoint_port_base": port,
    }
    kv.pop("replay_endpoint_port_base")
    runner, url = await serve_info({"kv_events": kv})
    metrics = AdapterMetrics("sglang")
    try:
        cfg = AdapterConfig(EngineKind.SGLANG, url, "r0", "m")
        async with SGLangAdapter(cfg, metrics=metrics) as adapter:
            assert adapter.engine_load("r0") is None

            async def heard() -> EngineLoad | None:
                await load_pub.send_multipart(frames(LOAD_STAT_FULL))
                return adapter.engine_load("r0")

            reading = await eventually(heard, "the engine's load reading")
            assert (reading.running, reading.queued, reading.kv_used_tokens) == (3, 2, 1184)

            async def counted() -> bool:
                await load_pub.send_multipart(frames(b"\x00\x01"))
                return metrics.value("decode_errors", worker="r0", kind="load") > 0

            await eventually(counted, "the corrupt message to be counted")
            assert adapter.engine_load("r0") is not None
    finally:
        await runner.cleanup()
        await engine.aclose()


async def test_flagged_load_endpoint_and_an_engine_without_one() -> None:
    """A flagged load endpoint needs a rank that publishes KV events; an adapter given none
    answers no reading (the gateway then goes by its own count)."""
    engine = FakeSGLangPublisher(block_size=4)
    try:
        kv = (EventEndpoint(0, engine.endpoint),)
        bad = AdapterConfig(
            EngineKind.SGLANG, "http://127.0.0.1:9", "w", "m", block_size=4, endpoints=kv,
            load_endpoints=(EventEndpoint(1, "tcp://127.0.0.1:5999"),),
        )
        with pytest.raises(AdapterError, match="DP ranks \\[1\\]"):
            await SGLangAdapter(bad).start()
        plain = AdapterConfig(
            EngineKind.SGLANG, "http://127.0.0.1:9", "w", "m", block_size=4, endpoints=kv
        )
        async with SGLangAdapter(plain) as adapter:
            assert adapter.load_subscriber is None and adapter.engine_load("w") is None
    finally:
        await engine.aclose()


async def test_adapters_without_a_load_source_answer_none() -> None:
    """The capability is part of every adapter: those whose engine publishes no load of its
    own answer None (TensorRT-LLM, the fake), and the fake can play an engine that does."""
    trt = TrtllmAdapter(AdapterConfig(EngineKind.TRTLLM, "http://127.0.0.1:9", "w", "m"))
    assert trt.engine_load("w") is None
    fake = FakeAdapter("w")
    async with fake:
        assert isinstance(fake, EngineAdapter) and fake.engine_load("w") is None
        fake.load = EngineLoad(1, 0, 16)
        assert fake.engine_load("w") == EngineLoad(1, 0, 16)
        assert fake.engine_load("other") is None


def test_sidecar_flag_is_sglangs_load_socket(capsys: pytest.CaptureFixture[str]) -> None:
    """``--load-endpoint`` is taken for SGLang and refused, naming why, for another engine."""
    base = ["--engine-url", "http://127.0.0.1:30000", "--worker-id", "r0"]
    flag = ["--load-endpoint", "tcp://127.0.0.1:5560"]
    assert SidecarConfig.from_args([*base, *flag], {}).load_endpoint == "tcp://127.0.0.1:5560"
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*base, "--engine", "trtllm", *flag], {})
    assert "--engine is not sglang" in capsys.readouterr().err


# --- SGLang's own classes, when installed -------------------------------------------------


@pytest.mark.sglang
def test_fixtures_are_sglangs_own() -> None:
    """SGLang's encoder and /server_info descriptor still make exactly the recorded fixtures."""
    load_publisher = pytest.importorskip(
        "sglang.srt.managers.scheduler_components.load_publisher"
    )
    from sglang.srt.runtime_context import describe_kv_events_publisher
    from sglang.srt.server_args import ServerArgs

    encode = load_publisher._encoder.encode
    stat = load_publisher.LoadStat
    assert encode(stat(3, 2, 1184, 20480, 0, 640, 1824, 48, 90112, 5200000)) == LOAD_STAT_FULL
    assert encode(stat(0, 0, 0, 0, 1)) == LOAD_STAT_RANK1
    assert load_publisher.LOAD_TOPIC == "load"
    events = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    args = ServerArgs(
        model_path="unused",
        kv_events_config=json.dumps(events),
        load_publish_endpoint="auto",
        page_size=16,
        dp_size=2,
    )
    assert describe_kv_events_publisher(args) == KV_EVENTS_WITH_LOAD
