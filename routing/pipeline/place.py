"""The place stage for one worker: which aggregated worker serves a request, or why none does.

A pair's placement is the PD coordinator's (``routing.pd.coordinator``); the exchange asks it
when the request goes to a pair, and asks here otherwise (and to re-run a failed handoff).
No worker is a ``Refusal`` (``routing.placement.refusal``), as it is for a pair and for the
endpoint picker; the policy's and the router's ``None`` becomes one here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvcore.errors import BAD_GATEWAY, RATE_LIMIT_EXCEEDED, SERVICE_UNAVAILABLE
from routing.pipeline.context import PipelineContext
from routing.placement.refusal import Refusal
from routing.placement.scorer import Placement, Reason
from routing.placement.sessions import SessionAffinity
from routing.prompt.preparer import PreparedPrompt
from routing.workers.registry import Role, Worker

__all__ = ["HOLDER_BUSY", "place_aggregated", "place_rerun"]

# A worker is free, but a busy one holds at least this share of the prompt's blocks more
# than it: with ``keep_prefix`` the request waits for the holder (routing.pipeline.admission).
KEEP_PREFIX_SHARE = 0.25
HOLDER_BUSY = Refusal(429, "the worker holding the request's prefix is busy; retry later",
                      RATE_LIMIT_EXCEEDED, busy=True, retry_after_s=1)


def place_aggregated(
    ctx: PipelineContext,
    prompt: PreparedPrompt,
    tried: set[str],
    only: Callable[[Worker], bool] | None = None,
    session: bytes | None = None,
    keep_prefix: bool = False,
    itl_target_s: float | None = None,
    follow: str | None = None,
) -> tuple[Worker, Placement] | Refusal:
    """A worker of the aggregated pool by ``--router-mode``, never one in ``tried``, none
    busy (``ctx.busy``); with ``only``, among the workers it accepts (the endpoint picker's
    subset hint); with ``session``, the session's worker while it is eligible; else with
    ``follow``, that worker while it is eligible (where the owner of a new prompt put it:
    routing/replicas/prompt_hold.py). With ``keep_prefix``, ``HOLDER_BUSY`` rather than a
    worker holding markedly less of the prefix than a busy one (``KEEP_PREFIX_SHARE`` of the
    prompt's blocks). ``itl_target_s``: the request's own ITL target, which the scorer prices
    (None: the gateway's)."""
    if only is None:
        ids = ctx.workers.routable_ids(Role.AGG)
    else:
        ids = [w.worker_id for w in ctx.workers.routable(Role.AGG) if only(w)]
    if not ids:
        return _none_left(tried, "no healthy worker is available")
    full: Sequence[str] = ()  # busy: achievable overlap for a prefix policy, not chosen
    if ctx.busy is not None:
        full = ctx.busy.of(ctx.router.load, ids)
        if full:
            if len(full) == len(ids):
                return Refusal(429, f"every worker is busy ({ctx.busy.describe()}); retry "
                               "later", RATE_LIMIT_EXCEEDED, busy=True, retry_after_s=1)
            busy = set(full)
            ids = [i for i in ids if i not in busy]
            if not ctx.policy.uses_prefix:
                full = ()
    sessions = ctx.sessions if session is not None else None
    placement = None
    if sessions is not None:
        placement = _pinned(ctx, sessions, session, prompt, ids, tried)  # type: ignore[arg-type]
    if placement is None and follow is not None and follow in ids and follow not in tried:
        placement = ctx.policy.choose(prompt.block_hashes, prompt.prompt_tokens, [follow],
                                      tried, (), itl_target_s)
    if placement is None:
        placement = ctx.policy.choose(prompt.block_hashes, prompt.prompt_tokens, ids, tried,
                                      full, itl_target_s)
    if placement is None:
        return _none_left(tried, "no worker available")
    if keep_prefix and _holder_busy(placement, len(prompt.block_hashes)):
        return HOLDER_BUSY
    if sessions is not None:
        sessions.placed(session, placement.worker_id, time.monotonic())  # type: ignore[arg-type]
    worker = ctx.workers.get(placement.worker_id)
    assert worker is not None  # placed among the registry's workers, synchronously
    return worker, placement


def _holder_busy(placement: Placement, num_blocks: int) -> bool:
    """Whether a busy worker holds markedly more of the prefix than the chosen one."""
    if placement.reason != Reason.CAPACITY:
        return False
    lost = placement.best_overlap - placement.overlap.longest
    return lost >= max(1, KEEP_PREFIX_SHARE * num_blocks)


def _pinned(ctx: PipelineContext, sessions: SessionAffinity, session: bytes,
            prompt: PreparedPrompt, ids: list[str], tried: set[str]) -> Placement | None:
    """The session's worker, if it is among the eligible ``ids``."""
    worker_id = sessions.worker_of(session, time.monotonic())
    if worker_id is None or worker_id not in ids or worker_id in tried:
        return None
    placement = ctx.policy.choose(prompt.block_hashes, prompt.prompt_tokens, [worker_id],
                                  tried, ())
    if placement is None:
        return None
    ctx.metrics.session_affinity_hits += 1
    return replace(placement, reason=Reason.AFFINITY)


def place_rerun(ctx: PipelineContext, prompt: PreparedPrompt,
                failure: str) -> tuple[Worker, Placement] | Refusal:
    """The aggregated worker that re-runs a request whose KV handoff failed with ``failure``
    (by overlap and load, whatever ``--router-mode``: the pair's prefill left blocks to
    reuse)."""
    ids = [w.worker_id for w in ctx.workers.routable(Role.AGG)]
    placement = ctx.router.place(prompt.block_hashes, prompt.prompt_tokens, ids)
    if placement is None:
        return Refusal(503, f"{failure}; no aggregated worker is available to re-run the "
                       "request", SERVICE_UNAVAILABLE, retry_after_s=1)
    return _worker(ctx, placement), placement


def _worker(ctx: PipelineContext, placement: Placement) -> Worker:
    worker = ctx.workers.get(placement.worker_id)
    assert worker is not None  # placed among the registry's workers, synchronously
    return worker


def _none_left(tried: set[str], why: str) -> Refusal:
    if tried:
        return Refusal(502, "every worker failed before answering", BAD_GATEWAY)
    return Refusal(503, why, SERVICE_UNAVAILABLE, retry_after_s=1)
