"""What the gateway's read-only views answer: ``/health``, ``/v1/models[/<model>]`` and
``/v1/workers`` (with the scorer's state).

Each view is a function of the parts it reads, so ``Gateway.handle`` only routes: it picks
the view and writes the reply. The bodies are the API's (``openapi.py`` documents them), so
they live together, apart from the gateway's life and its request routing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvcore.events import Tier
from routing.config import RouterConfig
from routing.http.client import UpstreamPool
from routing.pipeline.route_refusals import RouteRefusals
from routing.placement.kv_router import KvRouter
from routing.workers.registry import Health, WorkerRegistry

__all__ = ["health", "model_object", "models_body", "scorer_state", "workers_state"]


def health(workers: WorkerRegistry, draining: bool) -> tuple[int, bytes]:
    """``GET /health``: 200 while some worker is routable and the gateway is not draining."""
    routable = sum(w.health is Health.ROUTABLE for w in workers)
    status = "draining" if draining else "ok" if routable else "no healthy worker"
    body = orjson.dumps({"status": status, "healthy_workers": routable})
    return (200 if routable and not draining else 503), body


def model_object(name: str, created_s: float, max_model_len: int | None) -> dict[str, Any]:
    """OpenAI's model object (``max_model_len`` as vLLM and SGLang add it)."""
    return {
        "id": name,
        "object": "model",
        "created": int(created_s),
        "owned_by": "kvsidecar",
        "max_model_len": max_model_len,
    }


def models_body(names: Sequence[str], created_s: float, max_model_len: int | None) -> bytes:
    """``GET /v1/models``: every served name."""
    data = [model_object(n, created_s, max_model_len) for n in names]
    return orjson.dumps({"object": "list", "data": data})


def workers_state(
    cfg: RouterConfig,
    router: KvRouter,
    workers: WorkerRegistry,
    pool: UpstreamPool,
    refusals: RouteRefusals,
    pending: Mapping[str, str],
) -> dict[str, Any]:
    """``GET /v1/workers``: every worker, its health, load and cached blocks; ``pending``:
    the sidecars whose workers are not known yet, and why."""
    listed = list(workers)
    loads = router.load.loads([w.worker_id for w in listed], ())
    index = router.index
    known = set(index.worker_ids)
    out = []
    for worker, load in zip(listed, loads, strict=True):
        wid = worker.worker_id
        cached = {
            tier.name.lower(): index.num_blocks(wid, tier) if wid in known else 0
            for tier in Tier
        }
        health = worker.health
        engine_load = worker.engine_load
        out.append(
            {
                "worker_id": wid,
                "url": worker.address.url,
                # a sidecar's engine, as others reach it (the endpoint picker's pick)
                "engine_url": None if worker.engine is None else worker.engine.url,
                "kind": worker.kind.value,
                "role": worker.role.value,
                "health": health.value,
                "healthy": worker.probe_ok,
                "routable": health is Health.ROUTABLE,
                "reason": worker.reason,
                "in_flight": load.in_flight,
                "active_blocks": load.decode_blocks,
                "active_prefill_tokens": load.active_prefill_tokens,
                "capacity_blocks": worker.capacity_blocks,
                "load_source": worker.load_source.value,
                "engine_load": None if engine_load is None else engine_load.view(),
                "cached_blocks": cached,
                "requests": worker.dispatched,
                "models": list(worker.models),
                "last_error": worker.probe_error,
                "parity": worker.parity.value,
                "parity_reason": worker.parity_reason,
                "idle_connections": pool.idle_count(wid),
                # relayed routes its engine refused lately (asked again after a while)
                "refused_endpoints": refusals.of(wid),
                # the learned decode-interference model (None: no fit yet, or the term off)
                "itl_model": _itl_view(router, wid, load.in_flight),
            }
        )
    return {
        "router_mode": cfg.router_mode.value,
        "scorer": scorer_state(cfg, router),
        "workers": out,
        # Sidecars whose workers are not known yet, and why (unreachable, unauthorized).
        "pending_sidecars": [{"url": u, "reason": r} for u, r in pending.items()],
    }


def scorer_state(cfg: RouterConfig, router: KvRouter) -> dict[str, Any]:
    """The scorer's weights now, and whether each is learned (``tuning.py``)."""
    weights = router.scorer.weights
    tuner = router.tuner
    return {
        "overlap_weight": weights.overlap_weight,
        "prefill_load_scale": weights.prefill_load_scale,
        "learned": [
            name
            for name, value in (
                ("overlap_weight", cfg.overlap_weight),
                ("prefill_load_scale", cfg.prefill_load_scale),
            )
            if value is None
        ],
        "eviction_pressure": None if tuner is None else tuner.pressure,
        "decode_interference": _decode_view(router),
    }


def _decode_view(router: KvRouter) -> dict[str, Any] | None:
    """The decode-interference term's fleet-wide parameters (``interference.py``)."""
    learner = router.interference
    if learner is None:
        return None
    price = router.scorer.decode
    return {
        "weight": learner.weight,
        "itl_target_s": learner.itl_target_s,
        "priced": price is not None,
        # placements sent elsewhere than the cost without the term would have sent them
        "moves": router.scorer.decode_moves,
        "output_tokens": None if price is None else round(price.output_tokens, 2),
        "prefill_s_per_token": None if price is None else price.prefill_s_per_token,
        "units_per_s": None if price is None else round(price.units_per_s, 3),
        "fleet_itl_base_s": None if price is None else price.fleet.base_s,
        "fleet_itl_per_stream_s": None if price is None else price.fleet.per_stream_s,
    }


def _itl_view(router: KvRouter, worker_id: str, in_flight: int) -> dict[str, float] | None:
    """A worker's learned ITL model and the ITL it predicts with one more stream."""
    price = router.scorer.decode
    if price is None:
        return None
    model = price.model(worker_id)
    return {
        "base_s": model.base_s,
        "per_stream_s": model.per_stream_s,
        "next_itl_s": model.itl(in_flight + 1),
    }
