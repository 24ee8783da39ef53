"""bench_pressure's gateway flags: they reach our kv-routed runs (the default and the sweep),
never least-loaded's or Dynamo's; and the placement reasons it reads off ``/metrics``."""

from __future__ import annotations

import argparse

from tests.support.scripts import load_script

bench_pressure = load_script("bench_pressure")


def plan(*gateway_args: str, quick: bool = False) -> dict[str, dict[str, str]]:
    args = argparse.Namespace(dynamo=True, quick=quick, gateway_arg=list(gateway_args),
                              sweep_overlap=[1.0], sweep_scale=[10.0])
    return {label: extra for label, _stack, extra in bench_pressure.configs(args)}


def test_gateway_args_reach_our_kv_routed_runs_only() -> None:
    runs = plan("--decode-interference-weight=0", "--slo-itl-ms=50")
    assert runs["ours"]["EXTRA_GATEWAY_ARGS"].split() == [
        "--decode-interference-weight=0", "--slo-itl-ms=50"]
    assert runs["sweep_ow1_ps10"]["EXTRA_GATEWAY_ARGS"].split() == [
        "--decode-interference-weight=0", "--slo-itl-ms=50",
        "--overlap-weight", "1", "--prefill-load-scale", "10"]
    assert "EXTRA_GATEWAY_ARGS" not in runs["ours_least_loaded"]
    assert "EXTRA_GATEWAY_ARGS" not in runs["dynamo"]


def test_without_gateway_args_our_run_has_the_defaults() -> None:
    runs = plan(quick=True)
    assert runs["ours"]["EXTRA_GATEWAY_ARGS"].split() == []
    assert not any(label.startswith("sweep_") for label in runs)


def test_placement_reasons_are_read_off_the_metrics() -> None:
    text = (b'# TYPE kvsidecar_gateway_placement_reason_total counter\n'
            b'kvsidecar_gateway_placement_reason_total{reason="best"} 30.0\n'
            b'kvsidecar_gateway_placement_reason_total{reason="interference"} 10.0\n')
    found = {m.group(1).decode(): float(m.group(2))
             for m in bench_pressure._REASON.finditer(text)}
    assert found == {"best": 30.0, "interference": 10.0}
