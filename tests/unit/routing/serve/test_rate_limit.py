"""Token buckets: burst, refill, debt and the retry-after they announce."""

from __future__ import annotations

import pytest

from routing.serve.rate_limit import RateLimits, TenantBuckets, TokenBucket, retry_after_header


def test_a_full_bucket_grants_its_burst_then_says_how_long_to_wait() -> None:
    bucket = TokenBucket(rate=2.0, burst=2.0, now=0.0)
    assert bucket.take(1, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == pytest.approx(0.5)
    assert bucket.take(1, now=0.25) == pytest.approx(0.25)
    assert bucket.take(1, now=0.5) == 0.0


def test_a_cost_above_the_burst_passes_on_a_full_bucket_and_leaves_a_debt() -> None:
    bucket = TokenBucket(rate=100.0, burst=100.0, now=0.0)
    assert bucket.take(500, now=0.0) == 0.0  # never refused forever
    assert bucket.take(10, now=0.0) == pytest.approx(4.1)  # 400 of debt + 10, at 100/s
    assert bucket.take(10, now=4.11) == 0.0


def test_an_idle_bucket_banks_no_more_than_its_burst() -> None:
    bucket = TokenBucket(rate=1.0, burst=3.0, now=0.0)
    granted = [bucket.take(1, now=1000.0) for _ in range(4)]
    assert granted[:3] == [0.0, 0.0, 0.0] and granted[3] > 0


def test_an_unlimited_dimension_always_grants() -> None:
    buckets = TenantBuckets(RateLimits(requests_per_s=None, tokens_per_s=None))
    assert all(buckets.take_request() == 0.0 for _ in range(1000))
    assert buckets.take_tokens(10**9) == 0.0


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_limits_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ValueError, match="requests_per_s"):
        RateLimits(requests_per_s=value)


@pytest.mark.parametrize(("wait", "header"), [(0.01, b"1"), (1.0, b"1"), (1.2, b"2")])
def test_retry_after_is_whole_seconds_rounded_up(wait: float, header: bytes) -> None:
    assert retry_after_header(wait) == (b"retry-after: " + header
                                        + b"\r\nx-kvsidecar-shed-reason: rate_limit\r\n")
