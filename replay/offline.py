"""Offline replay: a trace through N simulated replicas, placed by the real routing core.

The fleet driver walks the trace in arrival order. Before each arrival every replica runs up
to that moment (``ReplicaSim.advance``); whatever the replicas published meanwhile (stored and
removed blocks, first tokens, finishes) reaches the router in time order, as the gateway would
hear it; then the policy places the request and the replica queues it. Policies are the
gateway's own (``routing.placement.policies``) over one ``KvRouter`` per run:

* ``kv``: overlap from the replicas' stored/removed events plus speculative prefixes, and load;
* ``approx``: no events, speculative prefixes only (kept ``approx_ttl_s``), and load;
* ``round-robin``, ``random``, ``least-loaded`` (fewest in flight).

The router's block is the trace's 512-token block, and the trace ids are its block hashes
(they are chained prefix hashes already). Pure and synchronous; seeded, so runs repeat.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import assert_never

from kvcore.events import BlockRemoved, BlockStored, Tier
from refengine.timing import TimingModel
from replay.notes import FirstToken, KvNote, Removed, RequestFinished, Stored, TokensGenerated
from replay.replica import ReplicaSim, SimRequest
from replay.summary import RequestOutcome
from replay.traces import TRACE_BLOCK_TOKENS, TraceRecord
from routing.config import RouterMode
from routing.placement.kv_router import KvRouter
from routing.placement.policies import make_policy, prediction
from routing.placement.scorer import ScoringWeights

__all__ = ["FleetConfig", "SimRun", "outcomes", "simulate"]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet: replicas, their cache and scheduler, and the router's settings."""

    replicas: int
    capacity_tokens: int  # per replica
    timing: TimingModel = field(default_factory=TimingModel)
    page_size: int = 16
    chunk_size: int = 512
    max_running: int = 64
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    learn_weights: bool = False  # the gateway's default: weights learned from feedback
    approx_ttl_s: float = 120.0  # the gateway's --approx-ttl-s (speculative prefixes)
    event_delay_s: float = 0.0  # sidecar → gateway latency of KV events
    speedup: float = 1.0  # arrivals compressed by this factor
    seed: int = 0
    closed_form: bool = True  # False: simulate every step one by one (slow; the reference)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.capacity_tokens < TRACE_BLOCK_TOKENS:
            raise ValueError(
                f"--capacity-tokens must hold one {TRACE_BLOCK_TOKENS}-token block, "
                f"got {self.capacity_tokens}"
            )
        if TRACE_BLOCK_TOKENS % self.page_size:
            raise ValueError(f"--page-size must divide {TRACE_BLOCK_TOKENS}, got {self.page_size}")
        if self.speedup <= 0 or not math.isfinite(self.speedup):
            raise ValueError(f"--speedup must be > 0, got {self.speedup}")
        if self.event_delay_s < 0:
            raise ValueError(f"event delay must be >= 0, got {self.event_delay_s}")

    @property
    def worker_ids(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.replicas)]


@dataclass(slots=True)
class SimRun:
    """Everything one policy's simulation produced."""

    policy: str
    requests: list[SimRequest]
    busy_s: dict[str, float]
    load_times: list[float]  # arrival times at which in-flight counts were sampled
    load: list[list[int]]  # per sample, in-flight requests per worker (worker order)
    itl_samples: list[tuple[float, float]]  # (interval s, weight), all replicas
    wall_s: float = 0.0


Progress = Callable[[int, int], None]


def _router(
    cfg: FleetConfig, policy: RouterMode, rng: random.Random, clock: list[float]
) -> KvRouter:
    # The replicas publish events as sidecars would; the mode says whether placement uses
    # them (approx does not). Speculation keeps approx_ttl_s in every mode.
    predict = prediction(policy, has_events=True, approx_ttl_s=cfg.approx_ttl_s)
    return KvRouter(
        block_size=TRACE_BLOCK_TOKENS,
        weights=cfg.weights,
        speculative_ttl_s=cfg.approx_ttl_s,
        use_events=predict.use_events,
        rng=rng,
        clock=lambda: clock[0],
        learn_overlap_weight=cfg.learn_weights,
        learn_prefill_load_scale=cfg.learn_weights,
    )


def _kv_event(worker: str, seq: int, note: KvNote) -> BlockStored | BlockRemoved:
    """``note`` as the KV event the replica's sidecar would publish (epoch 0, GPU tier)."""
    match note:
        case Stored(ids=ids, parent=parent):
            return BlockStored(worker, 0, seq, Tier.GPU, ids, parent)
        case Removed(ids=ids):
            return BlockRemoved(worker, 0, seq, Tier.GPU, ids)
        case unknown:
            assert_never(unknown)


def simulate(
    records: Sequence[TraceRecord],
    policy: RouterMode,
    cfg: FleetConfig,
    progress: Progress | None = None,
) -> SimRun:
    """Replay ``records`` through the fleet under ``policy``."""
    rng = random.Random(cfg.seed)
    clock = [0.0]
    router = _router(cfg, policy, rng, clock)
    chooser = make_policy(RouterMode(policy.value), router, rng)
    workers = cfg.worker_ids
    replicas = {
        w: ReplicaSim(
            w,
            capacity_tokens=cfg.capacity_tokens,
            timing=cfg.timing,
            page_size=cfg.page_size,
            chunk_size=cfg.chunk_size,
            max_running=cfg.max_running,
            closed_form=cfg.closed_form,
        )
        for w in workers
    }
    feed_events = chooser.uses_prefix and router.use_events  # nobody else reads them
    seqs = dict.fromkeys(workers, 0)
    live: dict[int, str] = {}  # request index → request id in the router

    reported: dict[int, int] = {}  # request index → output tokens told to the router

    def deliver(now: float) -> None:
        """Hand the router every note published up to ``now`` (events after their delay)."""
        for worker, replica in replicas.items():
            box = replica.outbox
            while box and box[0].at + cfg.event_delay_s <= now:
                note = box.popleft()
                if not feed_events:
                    continue
                seqs[worker] += 1
                router.apply(_kv_event(worker, seqs[worker], note))
            notes = replica.lifecycle
            while notes and notes[0].at <= now:
                match notes.popleft():
                    case TokensGenerated(index=index, total=total):
                        router.load.tokens_generated(live[index], total - reported.get(index, 0))
                        reported[index] = total
                    case FirstToken(index=index):
                        router.load.first_token(live[index])
                    case RequestFinished(index=index):
                        router.load.finish(live.pop(index))
                        reported.pop(index, None)
                    case unknown:
                        assert_never(unknown)

    requests: list[SimRequest] = []
    load_times: list[float] = []
    load: list[list[int]] = []
    total = len(records)
    for n, record in enumerate(records):
        now = record.arrival_s / cfg.speedup
        for replica in replicas.values():
            replica.advance(now)
        clock[0] = now
        deliver(now)
        ids = record.hash_ids
        placement = chooser.choose(ids, record.input_tokens, workers, ())
        if placement is None:  # cannot happen with a fixed fleet; keep the types honest
            raise RuntimeError("no worker to place a request on")
        req = SimRequest(record, now, worker=placement.worker_id)
        req.predicted_tokens = min(
            record.input_tokens, placement.overlap.longest * TRACE_BLOCK_TOKENS
        )
        rid = f"r{record.index}"
        router.dispatch(rid, placement, ids, record.input_tokens)
        replica = replicas[placement.worker_id]
        replica.add(req)
        if req.error is None:
            live[record.index] = rid
        else:
            router.load.finish(rid)
        requests.append(req)
        load_times.append(now)
        load.append([r.in_flight for r in replicas.values()])
        if progress is not None and (n % 256 == 0 or n == total - 1):
            progress(n + 1, total)
    for replica in replicas.values():
        replica.advance(math.inf)
    deliver(math.inf)
    samples: list[tuple[float, float]] = []
    for replica in replicas.values():
        samples.extend(replica.itl_samples)
    return SimRun(
        policy=policy.value,
        requests=requests,
        busy_s={w: r.busy_s for w, r in replicas.items()},
        load_times=load_times,
        load=load,
        itl_samples=samples,
    )


def outcomes(run: SimRun) -> list[RequestOutcome]:
    """The run's requests in the shape the report and the live replay share."""
    return [
        RequestOutcome(
            index=r.record.index,
            worker=r.worker,
            input_tokens=r.record.input_tokens,
            output_tokens=r.record.output_tokens,
            predicted_tokens=r.predicted_tokens,
            cached_tokens=r.cached_tokens,
            ttft=r.ttft,
            itl_mean=r.itl_mean,
            e2e=r.e2e,
            error=r.error,
        )
        for r in run.requests
    ]
