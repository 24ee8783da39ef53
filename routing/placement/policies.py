"""Placement policies: which worker a request goes to, one class per ``--router-mode``.

Every policy returns a ``Placement`` (worker, cost, predicted overlap; for ``kv`` and
``approx`` also the deepest overlap on offer and why the chosen worker won, tracked while
scoring; the others leave those unset and do no work for them) so the gateway commits
every request through ``KvRouter.dispatch`` and releases it through ``router.load``, whatever
the mode: least-loaded reads the same in-flight figures the KV cost uses.

``kv`` and ``approx`` both score with ``KvRouter`` (``PrefixAware``), and differ in what it
predicts overlaps from (``prediction``, which the gateway builds its router with):

* ``kv``: the sidecars' events (real overlap, every tier) plus a short speculation on
  just-routed prefixes, bridging the prefill and the event's trip. Plain workers publish no
  events, so for them the speculative prefixes (kept ``--approx-ttl-s``) are all there is and
  ``kv`` behaves like ``approx``.
* ``approx``: its own placements only, each prefix counted as cached on its worker for
  ``--approx-ttl-s``, with sidecars too: their events are not used to place.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, assert_never

from routing.config import RouterMode
from routing.placement.kv_router import KvRouter
from routing.placement.scorer import Placement, TierOverlap

__all__ = [
    "LeastLoaded",
    "Policy",
    "Prediction",
    "PrefixAware",
    "RandomChoice",
    "RoundRobin",
    "make_policy",
    "prediction",
]

_NO_OVERLAP = TierOverlap()
# With sidecar events a routed prefix is confirmed within milliseconds; speculation only has
# to bridge the prefill and the event's trip.
SPECULATIVE_TTL_WITH_EVENTS_S = 2.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the router predicts overlaps from, for a mode: ``KvRouter``'s ``use_events`` and
    ``speculative_ttl_s``."""

    use_events: bool
    speculative_ttl_s: float


def prediction(mode: RouterMode, *, has_events: bool, approx_ttl_s: float) -> Prediction:
    """``has_events``: the workers come with sidecars publishing their KV events."""
    if mode is RouterMode.APPROX:
        return Prediction(use_events=False, speculative_ttl_s=approx_ttl_s)
    ttl = SPECULATIVE_TTL_WITH_EVENTS_S if has_events else approx_ttl_s
    return Prediction(use_events=True, speculative_ttl_s=ttl)


class Policy(Protocol):
    """``choose`` picks among ``workers`` less ``exclude``; ``saturated`` (workers at their
    in-flight cap, never chosen) only tells a prefix policy the overlap it could not reach;
    ``itl_target_s``, the request's own ITL target (None: the gateway's), is priced by the
    scoring policies' decode term."""

    uses_prefix: bool  # does the policy look at block hashes?

    def choose(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        exclude: Collection[str],
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None: ...


def _eligible(workers: Sequence[str], exclude: Collection[str]) -> Sequence[str]:
    return [w for w in workers if w not in exclude] if exclude else workers


class RoundRobin:
    uses_prefix = False

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        exclude: Collection[str],
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None:
        eligible = _eligible(workers, exclude)
        if not eligible:
            return None
        i = self._next
        self._next = i + 1
        return Placement(eligible[i % len(eligible)], 0.0, _NO_OVERLAP)


class RandomChoice:
    uses_prefix = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        exclude: Collection[str],
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None:
        eligible = _eligible(workers, exclude)
        if not eligible:
            return None
        return Placement(self._rng.choice(eligible), 0.0, _NO_OVERLAP)


class LeastLoaded:
    """Fewest requests in flight; ties rotate so equal load spreads evenly."""

    uses_prefix = False

    def __init__(self, router: KvRouter) -> None:
        self._router = router
        self._turn = 0

    def choose(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        exclude: Collection[str],
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None:
        eligible = _eligible(workers, exclude)
        if not eligible:
            return None
        loads = self._router.load.loads(eligible, ())
        low = min(load.in_flight for load in loads)
        tied = [w for w, load in zip(eligible, loads, strict=True) if load.in_flight == low]
        self._turn += 1
        return Placement(tied[self._turn % len(tied)], float(low), _NO_OVERLAP)


class PrefixAware:
    """``kv`` and ``approx``: Dynamo's cost over real and speculative overlap plus load."""

    uses_prefix = True

    def __init__(self, router: KvRouter) -> None:
        self._router = router

    def choose(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        exclude: Collection[str],
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None:
        return self._router.place(
            block_hashes, prompt_tokens, workers, exclude=exclude, saturated=saturated,
            itl_target_s=itl_target_s,
        )


def make_policy(mode: RouterMode, router: KvRouter, rng: random.Random) -> Policy:
    match mode:
        case RouterMode.ROUND_ROBIN:
            return RoundRobin()
        case RouterMode.RANDOM:
            return RandomChoice(rng)
        case RouterMode.LEAST_LOADED:
            return LeastLoaded(router)
        case RouterMode.KV | RouterMode.APPROX:
            return PrefixAware(router)
        case _:
            assert_never(mode)
