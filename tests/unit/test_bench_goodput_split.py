"""bench_goodput's pooling of repeated runs, its split of each request's ITL at the decode
floor (the mocker's pure decode step with every KV page in use), the flood's figures over
tenants served side by side, and the goodput ratio against a baseline that met no target,
on made-up requests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.scripts import load_script

chat_load = load_script("_chat_load")
bench_goodput = load_script("bench_goodput")
Outcome, ChatResult = chat_load.Outcome, chat_load.ChatResult

FLOOR_S = bench_goodput.decode_floor_s(0.25)


def test_the_floor_is_the_mockers_full_kv_decode_step() -> None:
    """-25.74 + 54.01 + 5.74 ms at speed 1, four times that at speedup 0.25."""
    assert pytest.approx(4 * 34.01e-3) == FLOOR_S


def test_each_requests_mean_gap_splits_at_the_floor() -> None:
    """A gap at or under the floor is all decode; a longer one (a prompt chunk in its step)
    puts its excess beyond the floor. The parts add up to the mean of per-request means."""
    at_floor = Outcome(ok=True, gaps_s=[FLOOR_S, FLOOR_S - 0.002], prompt_tokens=100,
                       cached_tokens=60)
    mixed = Outcome(ok=True, gaps_s=[FLOOR_S, FLOOR_S + 0.2], prompt_tokens=100)
    failed = Outcome(ok=False, gaps_s=[9.0], prompt_tokens=1000)
    split = bench_goodput.itl_split(ChatResult([at_floor, mixed, failed], 2.0, []), 0.25)
    to_floor = ((2 * FLOOR_S - 0.002) / 2 + FLOOR_S) / 2
    assert split["itl_to_floor_ms"] == pytest.approx(to_floor * 1e3, abs=0.01)
    assert split["itl_over_floor_ms"] == pytest.approx(0.2 / 2 / 2 * 1e3, abs=0.01)
    assert split["itl_mean_ms"] == pytest.approx(
        split["itl_to_floor_ms"] + split["itl_over_floor_ms"], abs=0.02)
    assert split["gaps_with_prefill_share"] == 0.25  # one gap of four carries a prompt chunk
    assert split["computed_prompt_tokens_per_s"] == (40 + 100) / 2.0  # the failed one not


def test_a_gap_just_over_the_floor_carries_no_prompt_chunk() -> None:
    """Prefill adds at least its 16.5 ms base (speed 1): a few ms over the floor is delay."""
    late = Outcome(ok=True, gaps_s=[FLOOR_S + 0.010])
    split = bench_goodput.itl_split(ChatResult([late], 1.0, []), 0.25)
    assert split["gaps_with_prefill_share"] == 0.0
    assert split["itl_over_floor_ms"] == pytest.approx(10.0, abs=0.01)


def test_pooled_runs_keep_every_request_and_add_the_time() -> None:
    one = ChatResult([Outcome(ok=True, ttft_s=0.1)], 10.0, [])
    two = ChatResult([Outcome(ok=True, ttft_s=0.3), Outcome(ok=False)], 30.0, ["HTTP 503"])
    pooled = ChatResult.pooled([one, two])
    assert [o.ttft_s for o in pooled.outcomes] == [0.1, 0.3, 0.0]
    assert pooled.wall_s == 40.0 and pooled.errors == ["HTTP 503"]
    assert pooled.summary(1.0, 1.0)["req_per_s"] == 2 / 40


def test_learned_counts_add_up_over_runs_and_fits_are_averaged() -> None:
    runs = [{"interference_placements": 3.0, "overlap_weight": 18.0},
            {"interference_placements": 5.0, "overlap_weight": 20.0, "itl_base_ms": 130.0}]
    assert bench_goodput.pool_learned(runs) == {
        "interference_placements": 8.0, "overlap_weight": 19.0, "itl_base_ms": 130.0}


flood_load = load_script("_flood_load")
Tenant = flood_load.Tenant


def _tenant(name: str, ttfts: list[float], duration_s: float = 10.0) -> Any:
    return Tenant(name, 1, [Outcome(ok=True, ttft_s=t, gaps_s=[0.01], prompt_tokens=90,
                                    completion_tokens=10) for t in ttfts], [], duration_s)


def test_a_flood_rows_tenants_ran_side_by_side_and_the_quiet_ones_are_apart() -> None:
    """The tenants' requests pool over one window (not the sum of theirs); the quiet
    tenants' TTFT leaves the flooder's out; Jain's index over their tokens."""
    tenants = [_tenant("flood", [2.0, 2.0, 2.0, 2.0]), _tenant("quiet-a", [0.1, 0.2]),
               _tenant("quiet-b", [0.1, 0.2])]
    row = bench_goodput.flood_row(tenants, 0.5, 0.05)
    assert row["requests"] == 8 and row["req_per_s"] == 0.8
    assert row["goodput_req_per_s"] == 0.4  # the quiet tenants' four
    assert row["ttft_p99_ms"] == 2000.0 and row["quiet_ttft_p99_ms"] == 200.0
    assert row["jain_index"] == pytest.approx(8**2 / (3 * (4**2 + 2**2 + 2**2)), abs=1e-4)
    assert row["tokens_per_s"] == 800 / 10.0


def test_a_tenants_pooled_runs_keep_every_request_and_add_the_time() -> None:
    pooled = Tenant.pooled([_tenant("flood", [1.0]), _tenant("flood", [2.0, 3.0])])
    assert [o.ttft_s for o in pooled.outcomes] == [1.0, 2.0, 3.0]
    assert pooled.duration_s == 20.0 and pooled.tokens == 300


def test_a_baseline_that_met_no_target_gives_a_lower_bound_ratio() -> None:
    """Goodput against 0 is counted as one request over the baseline's runs, and said so."""
    report = bench_goodput.Report()
    ours = {"goodput_req_per_s": 4.0, "ttft_p99_ms": 900.0, "wall_s": 20.0}
    theirs = {"goodput_req_per_s": 0.0, "ttft_p99_ms": 600.0, "wall_s": 20.0}
    bench_goodput.compare(report, "flood", {"ours": ours, "dynamo": theirs},
                          {"ours": [ours], "dynamo": [theirs]}, ("dynamo",),
                          (("goodput_req_per_s", "higher"), ("ttft_p99_ms", "lower")))
    assert report.ratios["goodput_vs_dynamo_flood"] == 4.0 / (1 / 20.0)
    assert report.figures["goodput_vs_dynamo_flood_is_lower_bound"] == 1
    assert report.ratios["ttft_p99_vs_dynamo_flood"] == pytest.approx(600 / 900, abs=1e-3)
