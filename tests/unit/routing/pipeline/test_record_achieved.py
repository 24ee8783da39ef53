"""Achieved vs achievable in a request's record: headers, log line, metrics, prediction."""

from __future__ import annotations

import random
from dataclasses import replace

import orjson
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.config import RouterMode
from routing.metrics import GatewayMetrics
from routing.pipeline.place import place_aggregated
from routing.pipeline.record import RequestRecord
from routing.pipeline.relay import Relay
from routing.placement.policies import make_policy
from routing.placement.refusal import Refusal
from routing.placement.scorer import Placement, Reason, TierOverlap
from routing.prompt.preparer import PreparedPrompt
from tests.unit.routing.pipeline.test_stages import client, context, plain

BS = 16


def record(placement: Placement) -> RequestRecord:
    rec = RequestRecord("k-1", b"rid-1", "/v1/chat/completions", 100, 100.0)
    rec.placement, rec.worker_ids = placement, (placement.worker_id,)
    return rec


SCORED = Placement("w1", 3.0, TierOverlap(2), best_overlap=5, reason=Reason.LOAD)


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class TestScoredRecord:
    def test_headers_carry_the_best_overlap_and_the_reason(self) -> None:
        assert record(SCORED).headers() == (
            b"x-request-id: rid-1\r\nx-kvsidecar-worker: w1\r\nx-kvsidecar-cached-blocks: 2\r\n"
            b"x-kvsidecar-best-overlap-blocks: 5\r\nx-kvsidecar-placement-reason: load\r\n"
        )

    def test_unscored_placement_adds_no_header(self) -> None:
        """Round-robin and the like: the headers are as before, no best, no reason."""
        rec = record(Placement("w0", 0.0, TierOverlap()))
        assert b"best-overlap" not in rec.headers() and b"reason" not in rec.headers()

    def test_finish_counts_achieved_against_achievable_and_logs_it(self) -> None:
        m = GatewayMetrics()
        rec = record(SCORED)
        rec.reported_cached = 16  # the engine had one block, not the two predicted
        with capture_logs() as logs:
            rec.finish(200, m, BS, log_line=True)
        (line,) = [e for e in logs if e["event"] == "request_completed"]
        assert (line["best_overlap_blocks"], line["cached_blocks"]) == (5, 2)
        assert (line["placement_reason"], line["reported_cached_tokens"]) == ("load", 16)
        got = samples(m)
        assert got[("kvsidecar_gateway_placement_reason_total", (("reason", "load"),))] == 1
        assert got[("kvsidecar_gateway_best_overlap_blocks_total", ())] == 5
        assert got[("kvsidecar_gateway_chosen_overlap_blocks_total", ())] == 2
        assert got[("kvsidecar_gateway_missed_overlap_blocks_bucket", (("le", "2"),))] == 0
        assert got[("kvsidecar_gateway_missed_overlap_blocks_bucket", (("le", "4"),))] == 1
        w1 = (("worker", "w1"),)
        assert got[("kvsidecar_gateway_worker_prediction_checks_total", w1)] == 1
        assert got[("kvsidecar_gateway_worker_overpredicted_tokens_total", w1)] == 32 - 16
        assert ("kvsidecar_gateway_worker_underpredicted_tokens_total", w1) not in got

    def test_underprediction_and_no_usage(self) -> None:
        m = GatewayMetrics()
        rec = record(SCORED)
        rec.reported_cached = 80
        rec.finish(200, m, BS, log_line=False)
        record(SCORED).finish(200, m, BS, log_line=False)  # no usage: no check
        assert m.worker_prediction_checks == {"w1": 1}
        assert m.worker_underpredicted_tokens == {"w1": 80 - 32}
        assert m.placement_reasons == {"load": 2}

    def test_relay_hands_the_reported_cached_tokens_to_the_record(self) -> None:
        conn, _ = client()
        m = GatewayMetrics()
        rec = record(SCORED)
        relay = Relay(conn, rec, m, include_usage=False)
        usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 48}}
        body = orjson.dumps({"choices": [], "usage": usage})
        relay.head(200, b"application/json", len(body))
        relay.body([body])
        relay.complete()
        assert rec.reported_cached == 48
        assert m.worker_usage_prompt_tokens == {"w1": 100}


class TestPlaceAtTheCap:
    def test_a_saturated_holder_reads_capacity(self) -> None:
        """kv mode with --max-in-flight-per-worker 1: the worker holding the prefix is at its
        cap, so the request goes elsewhere, and the placement says why."""
        ctx = context(plain("a"), plain("b", 9001), cap=1)
        ctx = replace(ctx, policy=make_policy(RouterMode.KV, ctx.router, random.Random(0)))
        hashes = BlockHasher(BS).hash_tokens(list(range(BS * 6)), Namespace("m").seed)
        ctx.router.apply(BlockStored("a", 0, 1, Tier.GPU, hashes))
        prompt = PreparedPrompt(hashes, BS * 6, None, True)
        placed = place_aggregated(ctx, prompt, set())
        assert not isinstance(placed, Refusal)
        assert (placed[1].worker_id, placed[1].reason) == ("a", Reason.BEST)
        ctx.router.dispatch("r1", placed[1], hashes, BS * 6)
        placed = place_aggregated(ctx, prompt, set())
        assert not isinstance(placed, Refusal)
        assert (placed[1].worker_id, placed[1].reason) == ("b", Reason.CAPACITY)
        assert placed[1].best_overlap == 6 and placed[1].overlap.longest == 0
