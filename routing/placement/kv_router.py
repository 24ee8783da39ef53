"""The routing core assembled: prefix index + speculative prefixes + active load + scorer.

Pure and synchronous like its parts; the gateway drives it from its event loop::

    router.apply(event)                               # every sidecar event
    placement = router.place(block_hashes, prompt_tokens, workers)   # choose
    router.dispatch(request_id, placement, block_hashes, prompt_tokens)  # commit
    router.load.first_token(request_id) ... router.load.finish(request_id)

Self-tuning: unless fixed by the caller, the scorer's overlap weight and prefill load scale
follow the fleet's feedback (``tuning.py``), fed here from the events, the dispatches and the
first tokens. With ``decode_interference_weight`` > 0 the scorer also prices the decode
slowdown of one more stream (``interference.py``), learned from the gaps between the tokens
the gateway relays.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from routing.placement.active_load import ActiveLoad
from routing.placement.interference import DecodeInterference
from routing.placement.kv_move import MovePlanner
from routing.placement.peer_share import PeerShare
from routing.placement.pending import PendingPrefixes
from routing.placement.prefix_index import ApplyOutcome, PrefixIndex
from routing.placement.scorer import (
    LOWER_TIERS,
    Candidate,
    Placement,
    Pool,
    Reason,
    Scorer,
    ScoringWeights,
    TierOverlap,
)
from routing.placement.tuning import WeightTuner

__all__ = ["KvRouter"]

_DROPPED = (ApplyOutcome.DUPLICATE, ApplyOutcome.STALE_EPOCH)  # events the index ignored
_NONE: dict[str, int] = {}


class KvRouter:
    """KV-aware placement over a set of workers."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        weights: ScoringWeights | None = None,
        speculative_ttl_s: float = 2.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        load: ActiveLoad | None = None,
        learn_overlap_weight: bool = False,
        learn_prefill_load_scale: bool = False,
        use_events: bool = True,
        decode_interference_weight: float = 0.0,
        itl_target_s: float = 0.1,
    ) -> None:
        """``load``: the active load to keep (a subclass shares it with other gateway
        replicas: ``routing.replicas``); a plain ``ActiveLoad`` by default. ``learn_*``:
        the weight is tuned from feedback (``tuning.py``) instead of taken from ``weights``.
        ``use_events``: whether the events applied inform placement (``--router-mode``
        decides, ``policies.prediction``); without, the index still follows them (for the
        indexer API and the replicas) but overlaps are the speculative prefixes alone.
        ``decode_interference_weight``: how much the learned decode-interference term counts
        (0: not at all, the prefill-only cost); ``itl_target_s``: the ITL target it prices
        overshoot against."""
        self.block_size = block_size
        self.use_events = use_events
        self.index = PrefixIndex()
        self.pending = PendingPrefixes(speculative_ttl_s)
        self.load = ActiveLoad(block_size) if load is None else load
        weights = weights or ScoringWeights()
        self.scorer = Scorer(weights, block_size, rng)
        self._clock = clock
        # With other gateway replicas (--nats): their share of the workers for new prefixes.
        self.peer_share: PeerShare | None = None
        # With --kv-move on: a lighter worker may pull a busy holder's prefix (kv_move.py).
        self.move: MovePlanner | None = None
        self.tuner: WeightTuner | None = None
        self.interference: DecodeInterference | None = None
        decode = decode_interference_weight > 0
        if learn_overlap_weight or learn_prefill_load_scale or decode:
            self.tuner = WeightTuner(
                self.scorer,
                fixed_overlap=None if learn_overlap_weight else weights.overlap_weight,
                fixed_scale=None if learn_prefill_load_scale else weights.prefill_load_scale,
                fit_ttft=decode,
            )
            self.load.on_first_token = self._first_token
        if decode:
            assert self.tuner is not None
            self.interference = DecodeInterference(
                self.scorer, self.tuner, itl_target_s=itl_target_s,
                weight=decode_interference_weight, clock=clock,
            )
            self.load.observer = self.interference

    def apply(self, event: KVEvent) -> ApplyOutcome:
        """Feed one normalized event; a GPU store confirms speculative blocks, a GPU clear
        drops them (the worker's cache starts over: a restarted engine, a flush, a resync).
        Without ``use_events`` only the index takes it: speculation and tuning ignore it."""
        outcome = self.index.apply(event)
        if event.tier is not Tier.GPU or not self.use_events:
            return outcome
        kind = type(event)
        if kind is BlockStored:
            self.pending.confirm(event.worker_id, event.block_hashes)  # type: ignore[union-attr]
        elif kind is AllBlocksCleared:
            self.pending.forget_worker(event.worker_id)
        tuner = self.tuner
        if tuner is None or outcome in _DROPPED:
            return outcome
        if kind is BlockStored:
            tuner.blocks_stored(len(event.block_hashes))  # type: ignore[union-attr]
        elif kind is BlockRemoved:
            tuner.blocks_removed(len(event.block_hashes))  # type: ignore[union-attr]
        return outcome

    def enable_moves(self) -> MovePlanner:
        """Offer the pull option (``kv_move.py``) from now on: a worker whose sidecar has a
        store may pull a prefix from another worker's, priced against the prefill speed
        the tuner learns (its prior until then)."""
        tuner = self.tuner

        def has_store(worker_id: str) -> bool:
            try:
                return self.index.num_blocks(worker_id, Tier.HOST) > 0
            except KeyError:  # no event from it yet
                return False

        self.move = MovePlanner(
            self.block_size, clock=self._clock, has_store=has_store,
            prefill_s_per_token=lambda: None if tuner is None else tuner.prefill_s_per_token)
        return self.move

    def remove_worker(self, worker_id: str) -> list[str]:
        """A worker is gone: its blocks leave the index; returns its in-flight request ids."""
        self.index.remove_worker(worker_id)
        self.pending.forget_worker(worker_id)
        if self.interference is not None:
            self.interference.forget_worker(worker_id)
        return self.load.forget_worker(worker_id)

    def candidates(
        self,
        block_hashes: Sequence[int],
        workers: Sequence[str],
        stored_depths: list[int] | None = None,
    ) -> list[Candidate]:
        """Every worker's overlap (real or speculative) and load for this request; with
        ``stored_depths``, each worker's deepest real overlap (any tier, no speculation) is
        appended to it too. Without ``use_events`` nothing is real: the index is not read."""
        tiers = self.index.match_tiers(block_hashes) if block_hashes and self.use_events else {}
        gpu = tiers.get(Tier.GPU, _NONE)
        lower = len(tiers) > (1 if gpu else 0)  # a tier below the GPU holds some of it
        pending = self.pending.match(block_hashes, self._clock()) if block_hashes else {}
        loads = self.load.loads(workers, block_hashes)
        out = []
        for worker_id, worker_load in zip(workers, loads, strict=True):
            load = worker_load
            real = gpu.get(worker_id, 0)
            speculative = pending.get(worker_id, 0)
            if speculative > real and load.active_prefill_tokens:
                # The blocks only speculated on this worker are being prefilled right now by
                # requests in flight there; this request rides on that prefill instead of
                # queueing the same work again, so it does not count against the worker.
                shared = min(load.active_prefill_tokens, (speculative - real) * self.block_size)
                load = replace(load, active_prefill_tokens=load.active_prefill_tokens - shared)
            if lower:
                held = [tiers.get(tier, _NONE).get(worker_id, 0) for tier in LOWER_TIERS]
                overlap = TierOverlap(max(real, speculative), *held)
                if stored_depths is not None:
                    stored_depths.append(max(real, *held))
            else:
                overlap = TierOverlap(max(real, speculative))
                if stored_depths is not None:
                    stored_depths.append(real)
            out.append(Candidate(worker_id, overlap, load))
        return out

    def place(
        self,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[str],
        pool: Pool = Pool.AGGREGATED,
        exclude: Collection[str] = (),
        saturated: Sequence[str] = (),
        itl_target_s: float | None = None,
    ) -> Placement | None:
        """Choose a worker (None: no eligible worker). Does not record anything.
        ``saturated``: workers at their in-flight cap, never chosen, whose overlap counts
        as achievable (``Placement.best_overlap``, reason ``capacity``). ``itl_target_s``:
        the request's own ITL target (``x-kvsidecar-slo-itl-ms``; None: the gateway's).

        None stays the core's answer: it knows the workers it was given, not why they are
        all it has, so it has no status or message for the client. The stage that asked
        turns None into a ``Refusal`` (``refusal.py``) in its own words: the place stage
        (``routing.pipeline.place``) and the PD coordinator (``routing.pd``)."""
        eligible = [w for w in workers if w not in exclude] if exclude else list(workers)
        full = [w for w in saturated if w not in exclude] if saturated else []
        # (a decode pool places by room, which a presumed load must not take away)
        share = self.peer_share if pool is not Pool.DECODE else None
        move = self.move if pool is Pool.AGGREGATED else None
        stored: list[int] = []  # filled only for the shares and the moves
        scored = self.candidates(
            block_hashes,
            [*eligible, *full] if full else eligible,
            None if share is None and move is None else stored,
        )
        n = len(eligible)
        chosen: Sequence[Candidate] = scored[:n] if full else scored
        if share is not None:
            chosen = share.adjust(chosen, stored[:n] if full else stored, len(block_hashes))
        if move is None:
            return self.scorer.place(chosen, prompt_tokens, pool, scored[n:], itl_target_s)
        return self._place_or_move(move, chosen, scored, stored[:n], prompt_tokens,
                                   itl_target_s)

    def _place_or_move(self, move: MovePlanner, chosen: Sequence[Candidate],
                       scored: Sequence[Candidate], stored: Sequence[int],
                       prompt_tokens: int, itl_target_s: float | None) -> Placement | None:
        """The scorer's choice among ``chosen`` with the pull option offered (any scored
        worker's store, a busy one's too, may be the source); a move if the pull won it."""
        n = len(chosen)
        offered, plans = move.offer(chosen, scored, stored)
        placement = self.scorer.place(offered, prompt_tokens, Pool.AGGREGATED, scored[n:],
                                      itl_target_s)
        if placement is None:
            return None
        plan = plans.get(placement.worker_id)
        if plan is None:
            return placement
        move.planned()
        depths = list(placement.overlap.depths)  # the pulled blocks land in its host tier
        depths[Tier.HOST] = max(depths[Tier.HOST], plan.blocks)
        overlap = TierOverlap(*depths)
        return replace(placement, reason=Reason.MOVED, moved_from=plan.source_id,
                       overlap=overlap)

    def dispatch(
        self,
        request_id: str,
        placement: Placement,
        block_hashes: Sequence[int],
        prompt_tokens: int,
    ) -> None:
        """Commit a placement: count its load and speculate its prefix onto the worker."""
        cached_tokens = min(prompt_tokens, placement.overlap.longest * self.block_size)
        tuner = self.tuner
        if tuner is not None and tuner.collects_ttft:
            wl = self.load.load(placement.worker_id, block_hashes)
            prefill = wl.active_prefill_tokens + prompt_tokens - cached_tokens
            tuner.dispatched(request_id, prefill, wl.decode_blocks, self._clock())
        self.load.add(request_id, placement.worker_id, block_hashes, prompt_tokens, cached_tokens)
        if self.peer_share is not None:
            self.peer_share.placed(prompt_tokens - cached_tokens, len(block_hashes))
        self.pending.record(placement.worker_id, block_hashes, self._clock())

    def predict(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """Speculate a prefix onto a worker that no request of this router loads (yet): a new
        prompt claimed there for another replica's session (routing/replicas/prompt_hold.py)."""
        self.pending.record(worker_id, block_hashes, self._clock())

    def _first_token(self, request_id: str) -> None:
        if self.tuner is not None:
            self.tuner.first_token(request_id, self._clock())
