"""The place stage for one worker: which aggregated worker serves a request, or why none does.

A pair's placement is the PD coordinator's (``routing.pd.coordinator``); the exchange asks it
when the request goes to a pair, and asks here otherwise (and to re-run a failed handoff).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from routing.pipeline.context import PipelineContext
from routing.placement.scorer import Placement
from routing.prompt.preparer import PreparedPrompt
from routing.workers.registry import Role, Worker

__all__ = ["Refusal", "place_aggregated", "place_rerun"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """No worker for the request: the error the client gets."""

    status: int
    message: str
    type: str


def place_aggregated(
    ctx: PipelineContext,
    prompt: PreparedPrompt,
    tried: set[str],
    only: Callable[[Worker], bool] | None = None,
) -> tuple[Worker, Placement] | Refusal:
    """A worker of the aggregated pool by ``--router-mode``, never one in ``tried``, none
    past ``--max-in-flight-per-worker``; with ``only``, among the workers it accepts (the
    endpoint picker's subset hint)."""
    if only is None:
        ids = ctx.workers.routable_ids(Role.AGG)
    else:
        ids = [w.worker_id for w in ctx.workers.routable(Role.AGG) if only(w)]
    if not ids:
        return _none_left(tried, "no healthy worker is available")
    cap = ctx.max_in_flight_per_worker
    full: Sequence[str] = ()  # at the cap: achievable overlap for a prefix policy, not chosen
    if cap is not None:
        load = ctx.router.load
        open_ids = [i for i in ids if load.in_flight_on(i) < cap]
        if not open_ids:
            return Refusal(
                429,
                f"every worker is saturated ({cap} requests in flight each); retry later",
                "rate_limit_exceeded",
            )
        if len(open_ids) < len(ids) and ctx.policy.uses_prefix:
            full = [i for i in ids if load.in_flight_on(i) >= cap]
        ids = open_ids
    placement = ctx.policy.choose(prompt.block_hashes, prompt.prompt_tokens, ids, tried, full)
    if placement is None:
        return _none_left(tried, "no worker available")
    worker = ctx.workers.get(placement.worker_id)
    assert worker is not None  # placed among the registry's workers, synchronously
    return worker, placement


def place_rerun(ctx: PipelineContext, prompt: PreparedPrompt) -> tuple[Worker, Placement] | None:
    """The aggregated worker that re-runs a request whose KV handoff failed (by overlap and
    load, whatever ``--router-mode``: the pair's prefill left blocks to reuse)."""
    ids = [w.worker_id for w in ctx.workers.routable(Role.AGG)]
    placement = ctx.router.place(prompt.block_hashes, prompt.prompt_tokens, ids)
    return None if placement is None else (_worker(ctx, placement), placement)


def _worker(ctx: PipelineContext, placement: Placement) -> Worker:
    worker = ctx.workers.get(placement.worker_id)
    assert worker is not None  # placed among the registry's workers, synchronously
    return worker


def _none_left(tried: set[str], why: str) -> Refusal:
    if tried:
        return Refusal(502, "every worker failed before answering", "bad_gateway")
    return Refusal(503, why, "service_unavailable")
