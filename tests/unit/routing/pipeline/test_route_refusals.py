"""The routes workers' engines refused (``routing.pipeline.route_refusals``): remembered for a
while, then asked again."""

from __future__ import annotations

from routing.pipeline.route_refusals import RouteRefusals


def test_a_refusal_is_remembered_until_its_deadline() -> None:
    """A refused route is refused for ``ttl_s``, for that worker and route only."""
    refusals = RouteRefusals(ttl_s=60.0)
    refusals.add("w1", b"/v1/embeddings", now=100.0)
    assert refusals.refuses("w1", b"/v1/embeddings", now=159.0)
    assert not refusals.refuses("w2", b"/v1/embeddings", now=159.0)
    assert not refusals.refuses("w1", b"/v1/responses", now=159.0)
    assert refusals.of("w1", now=159.0) == ["/v1/embeddings"]
    assert not refusals.refuses("w1", b"/v1/embeddings", now=160.0)
    assert refusals.of("w1", now=160.0) == []


def test_expired_refusals_are_forgotten() -> None:
    """Once every refusal expired, none is remembered (placement skips the check)."""
    refusals = RouteRefusals(ttl_s=0.0)
    assert not refusals
    refusals.add("w1", b"/v1/embeddings")
    assert not refusals
    remembered = RouteRefusals(ttl_s=60.0)
    remembered.add("w1", b"/v1/embeddings")
    assert remembered


def test_not_served_names_the_workers_that_refused() -> None:
    """The reason names the routable workers that refused, lately or for this request."""
    refusals = RouteRefusals(ttl_s=60.0)
    refusals.add("w1", b"/v1/embeddings")
    why = refusals.not_served(b"/v1/embeddings", ["w2"], ["w1", "w2", "w3"])
    assert why is not None and "POST /v1/embeddings" in why and "w1, w2 refused" in why
    assert refusals.not_served(b"/v1/responses", [], ["w1", "w2"]) is None
