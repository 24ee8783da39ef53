"""bench_disagg runs the scenarios asked for, each with its baseline, and hands every gateway
the ``--gateway-arg`` flags: what a before/after comparison of one scenario under one gateway
setting (e.g. ``--decode-interference-weight 0``) needs."""

from __future__ import annotations

import pytest

from tests.support.scripts import load_script

bench = load_script("bench_disagg")


def _runs(*argv: str) -> list[tuple[str, str]]:
    args = bench._parser().parse_args(list(argv))
    return [(run.scenario, run.mode) for run in bench._runs(args)]


def test_every_scenario_runs_by_default() -> None:
    assert _runs() == [("mixed", "agg"), ("mixed", "disagg"), ("short", "agg"),
                       ("short", "disagg"), ("small", "agg"), ("small", "disagg"),
                       ("slow", "disagg"), ("early", "disagg")]


def test_early_alone_brings_its_baseline_and_nothing_else() -> None:
    """early's ratios divide by mixed's aggregated run, so that one runs too, not mixed/disagg."""
    assert _runs("--scenarios", "early") == [("mixed", "agg"), ("early", "disagg")]


def test_chosen_scenarios_run_in_the_bench_order() -> None:
    assert _runs("--scenarios", "early", "mixed") == [
        ("mixed", "agg"), ("mixed", "disagg"), ("early", "disagg")]
    assert _runs("--scenarios", "short") == [("short", "agg"), ("short", "disagg")]


def test_an_unknown_scenario_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["--scenarios", "mixd"])


def test_gateway_args_reach_every_gateway_of_every_run() -> None:
    args = bench._parser().parse_args(["--gateway-arg=--decode-interference-weight=0",
                                       "--gateway-arg=--seed=3"])
    for run in bench._runs(args):
        (gateway,) = bench._spec(run, args).gateways
        assert gateway.args == ("--decode-interference-weight=0", "--seed=3")
        assert gateway.kv_load_failure_policy == run.policy  # the run's own flag stays


def test_no_gateway_arg_adds_nothing() -> None:
    args = bench._parser().parse_args([])
    assert all(bench._spec(run, args).gateways[0].args == () for run in bench._runs(args))
