"""Placement for the endpoint picker: the gateway's own stages, answered with an address.

A request Envoy holds is parsed, its model checked and its prompt prepared exactly as the
gateway does (``routing.pipeline.admit``), placed by ``place_aggregated`` (same policy,
router, registry, ``--max-in-flight-per-worker``), and committed to the router's load. The
pick is the worker's **engine**: Envoy sends the client's OpenAI body to it unchanged, which
a plain worker and a sidecar's engine serve, while the sidecar keeps feeding the engine's KV
events to the index. The request's load is released when its response ends (``Pick.finish``).
No pick is a ``Refusal`` (``routing.placement.refusal``), as no worker is for the gateway:
Envoy answers the client with its status and OpenAI-shaped body.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace

import structlog

from kvcore.errors import OpenAIError
from routing.pipeline.admit import check_model
from routing.pipeline.place import place_aggregated
from routing.pipeline.record import RequestRecord
from routing.placement.refusal import Refusal
from routing.prompt.openai_api import Endpoint, parse_request
from routing.prompt.preparer import PreparedPrompt
from routing.serve.gateway import Gateway
from routing.workers.registry import Worker, WorkerKind

__all__ = ["EndpointPicker", "Pick", "endpoint_of"]

log = structlog.get_logger("routing.epp", component="epp")
_ENDPOINTS = {e.value: e for e in Endpoint}
_NO_PROMPT = PreparedPrompt((), 0, None, False)


def endpoint_of(worker: Worker) -> str | None:
    """The ``ip:port`` Envoy sends a request for ``worker`` to: a plain worker itself, a
    sidecar worker's engine (None when its sidecar does not say where that is)."""
    address = worker.address if worker.kind is WorkerKind.PLAIN else worker.engine
    if address is None:
        return None
    host = address.host
    return f"[{host}]:{address.port}" if ":" in host else f"{host}:{address.port}"


class Pick:
    """One placed request, from the pick to the end of its response."""

    __slots__ = ("_picker", "done", "endpoint", "key", "record", "status", "worker_id")

    def __init__(self, picker: EndpointPicker, endpoint: str, key: str,
                 record: RequestRecord) -> None:
        self._picker = picker
        self.endpoint = endpoint
        self.key = key
        self.record = record
        self.worker_id = record.worker_id
        self.status = 0  # the engine's, once Envoy relays the response headers
        self.done = False

    def response_started(self, status: int) -> None:
        self.status = status

    def response_body(self, chunk: bytes) -> None:
        """A piece of the response: the first ends the prefill; SSE events are tokens."""
        record, load = self.record, self._picker.gateway.router.load
        now = time.monotonic()
        known = load.worker_of(self.key) is not None  # its worker may have left meanwhile
        if not record.t_first:
            record.t_first = now
            self._picker.gateway.metrics.ttft.observe(now - record.t_start)
            if known:
                load.first_token(self.key)
        record.t_last = now
        events = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        if events > 0:
            record.events += events
            if known:
                load.tokens_generated(self.key, events)

    def finish(self) -> None:
        """The response ended (or Envoy's stream did): release the load, count, log."""
        if self.done:
            return
        self.done = True
        gateway = self._picker.gateway
        gateway.router.load.finish_if_known(self.key)
        status = self.status or 499  # no response headers: the client or Envoy gave up
        self.record.finish(status, gateway.metrics, gateway.router.block_size,
                           gateway.ctx.log_requests)
        self._picker.in_flight.pop(self.key, None)


class EndpointPicker:
    """Places requests on the gateway's workers and answers with their engines' address."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.in_flight: dict[str, Pick] = {}
        self._next_key = 0

    @property
    def ready(self) -> bool:
        """Whether the picker knows its workers (discovered at least one)."""
        return len(self.gateway.workers) > 0

    def routable_endpoints(self) -> list[str]:
        return [e for w in self.gateway.workers.routable() if (e := endpoint_of(w))]

    def pick(
        self,
        path: str,
        body: bytes | None,
        request_id: bytes,
        subset: Collection[str] | None = None,
    ) -> Pick | Refusal:
        """Place the request ``POST path`` with ``body`` (None: a request without one, placed
        by load), among ``subset`` (``ip:port`` each) when Envoy gives one."""
        ctx = self.gateway.ctx
        self._next_key += 1
        key = f"epp-{self._next_key}"
        endpoint = _ENDPOINTS.get(path.split("?", 1)[0])
        record = RequestRecord(key, request_id, endpoint.value if endpoint else "other", 0,
                               time.monotonic())
        prepared = _NO_PROMPT
        if endpoint is not None and body is not None:
            try:
                parsed = check_model(parse_request(endpoint, body), ctx.model_names())
                prepared = ctx.prompts.prepare(parsed)
            except OpenAIError as exc:
                return self._refuse(record, Refusal.of(exc))
        record.prompt_tokens = prepared.prompt_tokens

        def eligible(worker: Worker) -> bool:
            address = endpoint_of(worker)
            return address is not None and (subset is None or address in subset)

        placed = place_aggregated(ctx, prepared, set(), eligible)
        ctx.metrics.placement.observe(time.monotonic() - record.t_start)
        if isinstance(placed, Refusal):
            if subset is not None:
                placed = replace(placed, message=f"{placed.message} among the {len(subset)} "
                                 "endpoints of the subset hint")
            return self._refuse(record, placed)
        worker, placement = placed
        ctx.router.dispatch(key, placement, prepared.block_hashes, prepared.prompt_tokens)
        worker.dispatched += 1
        record.placement, record.worker_ids = placement, (worker.worker_id,)
        address = endpoint_of(worker)
        assert address is not None  # eligible() admitted only workers with one
        pick = Pick(self, address, key, record)
        self.in_flight[key] = pick
        log.debug(
            "endpoint_picked",
            request_id=request_id.decode(errors="replace"),
            worker_id=worker.worker_id,
            endpoint=address,
            cached_blocks=placement.overlap.longest,
            prompt_tokens=prepared.prompt_tokens,
        )
        return pick

    def _refuse(self, record: RequestRecord, refusal: Refusal) -> Refusal:
        ctx = self.gateway.ctx
        record.finish(refusal.status, ctx.metrics, ctx.router.block_size, ctx.log_requests)
        log.info("pick_refused", request_id=record.request_id.decode(errors="replace"),
                 status=refusal.status, reason=refusal.message)
        return refusal
