"""The KV-event silence detector and its canary: evidence, suspicion, verdict, way back."""

from __future__ import annotations

import random
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sidecar.canary import CanaryLoop, canary_request
from sidecar.health import RoutingHealth, SilenceDetector, cacheable_tokens, stores_new_blocks
from tests.unit.adapters.fake_adapter import FakeAdapter

BLOCK = 16
SILENT_S = 30.0


class Clock:
    """The detector's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def detector(clock: Clock) -> SilenceDetector:
    return SilenceDetector(SILENT_S, clock)


def served(d: SilenceDetector, clock: Clock, stored_new: bool, took_s: float = 0.1) -> None:
    """One request that ran for ``took_s`` and was answered."""
    started = d.now()
    clock.advance(took_s)
    d.on_served(started, stored_new)


def silent_verdict(d: SilenceDetector, clock: Clock) -> None:
    """A canary is sent and answered, and no event comes within the deadline."""
    assert d.canary_due()
    d.canary_sent()
    clock.advance(0.2)
    d.canary_answered()
    clock.advance(SILENT_S)
    d.check()


class TestEvidence:
    def test_cacheable_tokens_stop_short_of_the_last_token(self) -> None:
        """A prompt of exactly k blocks can have k-1 cached: its last token is computed."""
        assert cacheable_tokens(0, BLOCK) == 0
        assert cacheable_tokens(16, BLOCK) == 0
        assert cacheable_tokens(17, BLOCK) == 16
        assert cacheable_tokens(32, BLOCK) == 16
        assert cacheable_tokens(33, BLOCK) == 32

    def test_an_exact_repeat_of_a_cached_prompt_stores_nothing(self) -> None:
        """The engine's cached tokens on a repeat cover every cacheable block: no evidence."""
        assert stores_new_blocks(40, BLOCK, cached_tokens=0)
        assert not stores_new_blocks(40, BLOCK, cached_tokens=32)
        assert not stores_new_blocks(32, BLOCK, cached_tokens=16)  # as SGLang reports it
        assert stores_new_blocks(49, BLOCK, cached_tokens=32)  # one more block stored

    def test_prefixes_are_new_once(self, detector: SilenceDetector) -> None:
        """Without cached tokens, only the first sight of a prompt's blocks is evidence."""
        assert detector.first_seen(7)
        assert not detector.first_seen(7)
        assert detector.first_seen(8)


class TestSuspicion:
    def test_exact_repeats_never_make_it_suspicious(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """The issue's scenario: one new prompt with its events, repeats, then a long quiet."""
        served(detector, clock, stores_new_blocks(40, BLOCK, 0))
        detector.on_event()
        for _ in range(3):
            served(detector, clock, stores_new_blocks(40, BLOCK, 32))
        for _ in range(10):
            clock.advance(SILENT_S)
            detector.check()
            assert not detector.canary_due()
        assert detector.health().routable and detector.num_canaries == 0

    def test_repeats_without_cached_tokens_never_make_it_suspicious(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """The fallback: a prompt seen before is no evidence, however often it comes."""
        served(detector, clock, detector.first_seen(42))
        detector.on_event()
        for _ in range(5):
            served(detector, clock, detector.first_seen(42))
        clock.advance(10 * SILENT_S)
        assert not detector.canary_due() and detector.health().routable

    def test_new_blocks_without_an_event_call_for_a_canary(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """Silence after a request that stored blocks is a suspicion, re-checked first."""
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S - 1)
        assert not detector.canary_due()
        clock.advance(1)
        assert detector.canary_due()
        assert detector.health().routable  # suspected, not convicted

    def test_an_event_during_the_request_answers_it(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """An event that came while the request ran (before its answer) counts for it."""
        started = detector.now()
        clock.advance(0.05)
        detector.on_event()
        clock.advance(0.05)
        detector.on_served(started, stored_new=True)
        clock.advance(10 * SILENT_S)
        assert not detector.canary_due()


class TestCanaryVerdict:
    def test_canary_events_keep_it_routable(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """Suspicion, canary, its stored events: routable, nothing more is due."""
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S)
        assert detector.canary_due()
        detector.canary_sent()
        assert not detector.canary_due()  # one at a time
        clock.advance(0.2)
        detector.on_event()  # the canary's blocks, published before its answer came back
        detector.canary_answered()
        clock.advance(SILENT_S)
        detector.check()
        assert detector.health().routable
        clock.advance(10 * SILENT_S)
        assert not detector.canary_due()
        assert detector.view()["canary"] == "idle"

    def test_silent_canary_makes_it_unroutable_until_a_later_canary_sees_events(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """No event for the canary: unroutable with the reason; re-checked, and back."""
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S)
        detector.canary_sent()
        detector.canary_answered()
        clock.advance(SILENT_S - 0.1)
        detector.check()
        assert detector.health().routable  # its deadline has not passed
        clock.advance(0.1)
        detector.check()
        health = detector.health()
        assert not health.routable
        assert "published no KV event" in health.reason and "--kv-events-config" in health.reason
        assert "routable again" in health.reason  # it names the way back
        assert not detector.canary_due()  # rate-limited
        clock.advance(SILENT_S)
        silent_verdict(detector, clock)  # the next re-check is silent too
        assert not detector.health().routable
        clock.advance(SILENT_S)
        assert detector.canary_due()
        detector.canary_sent()
        detector.canary_answered()
        clock.advance(1)
        detector.on_event()
        assert detector.health() == RoutingHealth(True)
        assert detector.view()["silent"] is False
        assert detector.num_canaries == 3 and detector.num_silent_verdicts == 2

    def test_any_event_brings_an_unroutable_worker_back(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """Events of anything (a removal, say) between canaries end the silence."""
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S)
        silent_verdict(detector, clock)
        assert not detector.health().routable
        clock.advance(1)
        detector.on_event()
        assert detector.health().routable
        clock.advance(10 * SILENT_S)
        assert not detector.canary_due()

    def test_the_verdict_names_where_the_events_were_awaited(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """A wrong endpoint is silent too: the reason names it and the flag that chose it."""
        detector.listening_on("tcp://127.0.0.1:5999 (the sidecar's --kv-events-endpoint)")
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S)
        silent_verdict(detector, clock)
        reason = detector.health().reason
        assert "on tcp://127.0.0.1:5999 (the sidecar's --kv-events-endpoint)" in reason

    def test_a_failed_canary_gives_no_verdict_and_is_retried(
        self, detector: SilenceDetector, clock: Clock
    ) -> None:
        """An engine that does not answer the canary is not convicted; it is asked again."""
        served(detector, clock, stored_new=True)
        clock.advance(SILENT_S)
        detector.canary_sent()
        detector.canary_failed()
        clock.advance(10 * SILENT_S)
        detector.check()
        assert detector.health().routable
        assert detector.canary_due()


class TestCanaryLoop:
    def test_canary_request_is_fresh_and_small(self) -> None:
        """Two blocks and a token of new ids, one token out; two canaries differ."""
        rng = random.Random(1)
        a, b = canary_request("m", BLOCK, rng), canary_request("m", BLOCK, rng)
        assert len(a.prompt_token_ids) == 2 * BLOCK + 1 and a.max_tokens == 1
        assert a.prompt_token_ids[:BLOCK] != b.prompt_token_ids[:BLOCK]
        assert a.request_id != b.request_id

    @pytest.mark.parametrize(("status", "answered"), [(200, True), (500, False)])
    async def test_send_reports_the_engines_answer(
        self, clock: Clock, status: int, answered: bool
    ) -> None:
        """The canary goes through the adapter to the engine; its answer starts the deadline,
        a refusal retries later."""
        bodies: list[dict[str, object]] = []

        async def echo(request: web.Request) -> web.Response:
            bodies.append(await request.json())
            return web.json_response({"text": "x"}, status=status)

        app = web.Application()
        app.router.add_post("/echo", echo)
        detector = SilenceDetector(SILENT_S, clock)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            loop = _loop(detector, session, str(server.make_url("")), lambda: True)
            assert await loop.send() is answered
        assert len(bodies) == 1 and len(bodies[0]["input_ids"]) == 2 * 4 + 1  # type: ignore[arg-type]
        assert detector.view()["canary"] == ("answered" if answered else "idle")
        assert detector.num_canaries == 1


def _loop(
    detector: SilenceDetector,
    session: aiohttp.ClientSession,
    url: str,
    may_send: Callable[[], bool],
) -> CanaryLoop:
    adapter = FakeAdapter(block_size=4)
    return CanaryLoop(detector, adapter, session, engine_url=url, model_id="m", block_size=4,
                      timeout_s=5.0, may_send=may_send)
