"""Gateway metrics render as Prometheus text."""

from __future__ import annotations

from routing.metrics import GatewayMetrics, Histogram


def test_histogram_buckets_are_cumulative() -> None:
    """Observations land in the first bucket whose bound they do not exceed."""
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0):
        h.observe(value)
    assert h.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert abs(h.total - 2.65) < 1e-9


def test_render_has_counters_histograms_and_worker_gauges() -> None:
    """Counters, histograms and per-worker gauges appear under the gateway prefix."""
    m = GatewayMetrics()
    m.count_response("/v1/completions", 200)
    m.count_response("/v1/completions", 200)
    m.ttft.observe(0.003)
    m.set_gauge_source(
        lambda: {
            "workers": [
                {
                    "worker_id": "w0",
                    "healthy": True,
                    "in_flight": 3,
                    "active_blocks": 9,
                    "active_prefill_tokens": 40,
                }
            ]
        }
    )
    text = m.render().decode()
    assert 'kvsidecar_gateway_responses_total{endpoint="/v1/completions",status="200"} 2.0' in text
    assert 'kvsidecar_gateway_ttft_seconds_bucket{le="0.005"} 1.0' in text
    assert 'kvsidecar_gateway_worker_in_flight{worker="w0"} 3.0' in text
    assert "kvsidecar_gateway_predicted_cached_tokens_total 0.0" in text
