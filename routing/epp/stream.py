"""One ``ext_proc`` stream: Envoy's messages for one HTTP request in, the picker's answers out.

Envoy opens a bidirectional ``Process`` stream per HTTP request and sends, in order,
``request_headers``, the body (``request_body`` messages, the last with ``end_of_stream``),
maybe ``request_trailers``, then the same for the response. What it expects back depends on
its processing mode, which its first message carries (``protocol_config``) or, from an older
Envoy, the ``--body-mode`` flag says:

* ``FULL_DUPLEX_STREAMED`` (the InferencePool's mode): nothing until the body has ended;
  then the headers answer, carrying the pick, and the body sent back whole. Response bodies
  are streamed back chunk by chunk as they come.
* ``BUFFERED`` (and ``BUFFERED_PARTIAL``): the headers answered at once (continue), the one
  body message answered with the pick as a header mutation.
* ``STREAMED`` and ``NONE`` (no body sent): picked from the headers, by load, and each body
  chunk answered as it comes. Envoy reads a header mutation on a body chunk's answer only in
  buffered mode, so a pick made at the last chunk would be ignored: neither mode lets the
  pick see the prompt before Envoy commits the headers, which is why InferencePools use full
  duplex (a streamed-mode pick is counted, ``streamed_by_load``, and logged once).

The answer that carries the pick sets ``clear_route_cache``, as GIE's reference picker does,
so Envoy routes again with the destination header. A body sent back (full duplex) goes in
pieces of at most 62,000 bytes, as GIE's reference splits it (Envoy recommends at most
64 KiB a message). A subset hint is a list of ``ip:port`` or one comma-separated string (as
header-to-metadata filters write it), or a mix.

A request without a body (headers with ``end_of_stream``) is picked by load at once. The pick
goes in the ``x-gateway-destination-endpoint`` header and in the dynamic metadata
``envoy.lb`` → ``x-gateway-destination-endpoint``, both ``ip:port``; a request that cannot be
placed gets an ``ImmediateResponse`` (400 for a bad body, 503 when no endpoint is ready, 429
when every worker is saturated), OpenAI-shaped, and the stream ends.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from routing.epp.config import BodyMode
from routing.epp.deps import Protos
from routing.epp.picker import EndpointPicker, Pick
from routing.placement.refusal import Refusal

__all__ = ["BODY_PIECE_BYTES", "DESTINATION", "LB_NAMESPACE", "SERVED", "SUBSET",
           "SUBSET_NAMESPACE", "PickStream"]

log = structlog.get_logger("routing.epp", component="epp")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
BODY_PIECE_BYTES = 62_000  # at most this much body in one message to Envoy


class _Body(enum.Enum):
    """How Envoy sends the request body (``ProcessingMode.BodySendMode``)."""

    FULL_DUPLEX = "full_duplex"  # chunks without waiting; everything answered at the end
    BUFFERED = "buffered"  # headers answered first, then the body whole (or partial)
    STREAMED = "streamed"  # headers answered first, then each chunk answered
    NONE = "none"  # no body is sent: picked from the headers


@dataclass(slots=True)
class _Modes:
    request: _Body
    response_full_duplex: bool

    @property
    def request_full_duplex(self) -> bool:
        return self.request is _Body.FULL_DUPLEX


class PickStream:
    """The state of one ``Process`` stream (one HTTP request through Envoy)."""

    def __init__(self, picker: EndpointPicker, protos: Protos, body_mode: BodyMode,
                 max_body_bytes: int, counts: dict[str, int]) -> None:
        self._picker = picker
        self._p = protos
        full = body_mode is BodyMode.FULL_DUPLEX
        self._modes = _Modes(_Body.FULL_DUPLEX if full else _Body.BUFFERED, full)
        self._max_body_bytes = max_body_bytes
        self._counts = counts  # outcome → count, for /metrics
        self._path = ""
        self._request_id = b""
        self._subset: list[str] | None = None
        self._body: list[bytes] = []
        self._body_bytes = 0
        self.pick: Pick | None = None
        self.ended = False  # an immediate response was sent: the stream is over

    # --- Envoy's messages ----------------------------------------------------------------

    def on_message(self, req: Any) -> Iterator[Any]:
        """The answers to one ``ProcessingRequest`` (none, one or two)."""
        if req.HasField("protocol_config"):
            self._take_modes(req.protocol_config)
        if req.HasField("metadata_context"):
            self._take_metadata(req.metadata_context)
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            yield from self._request_headers(req.request_headers)
        elif kind == "request_body":
            yield from self._request_body(req.request_body)
        elif kind == "request_trailers":
            if self.pick is None and not self.ended:  # the body ended with trailers
                yield from self._picked(self._body_so_far())
            if not self.ended:
                yield self._msg(request_trailers=self._p.ext_proc.TrailersResponse())
        elif kind == "response_headers":
            yield from self._response_headers(req.response_headers)
        elif kind == "response_body":
            yield from self._response_body(req.response_body)
        elif kind == "response_trailers":
            yield self._msg(response_trailers=self._p.ext_proc.TrailersResponse())
            self.close()

    def close(self) -> None:
        """The stream ended: the request's load is released (once)."""
        if self.pick is not None:
            self.pick.finish()

    # --- the request ---------------------------------------------------------------------

    def _request_headers(self, headers: Any) -> Iterator[Any]:
        for h in headers.headers.headers:
            name = h.key.lower()
            if name == ":path":
                self._path = _value(h)
            elif name == "x-request-id":
                self._request_id = _value(h).encode()
        mode = self._modes.request
        if headers.end_of_stream or mode is _Body.NONE or mode is _Body.STREAMED:
            # no body (a GET), none will be sent, or it comes after Envoy needs the pick:
            # placed by load
            if mode is _Body.STREAMED and not headers.end_of_stream:
                self._count("streamed_by_load")
                if self._counts["streamed_by_load"] == 1:
                    log.warning("epp_streamed_body_mode", path=self._path,
                                effect="picked by load from the headers: the prompt comes "
                                "too late; set the ext_proc filter's request_body_mode to "
                                "FULL_DUPLEX_STREAMED (or BUFFERED) for prefix-aware picks")
            yield from self._picked(None, headers_phase=True)
        elif not self._modes.request_full_duplex:
            yield self._msg(request_headers=self._p.ext_proc.HeadersResponse())

    def _request_body(self, body: Any) -> Iterator[Any]:
        if self.ended:
            return
        if self.pick is not None:
            if self._modes.request is _Body.STREAMED:  # picked at the headers: pass it on
                yield self._msg(request_body=self._p.ext_proc.BodyResponse())
            return
        self._body_bytes += len(body.body)
        if self._body_bytes > self._max_body_bytes:
            yield self._refused(Refusal(
                413, f"request body exceeds {self._max_body_bytes} bytes (--max-body-bytes)",
                None))
            return
        self._body.append(body.body)
        # A buffered body comes whole in one message (or as much of it as Envoy buffers).
        if body.end_of_stream or self._modes.request is _Body.BUFFERED:
            yield from self._picked(self._body_so_far())

    def _body_so_far(self) -> bytes:
        return b"".join(self._body)

    def _picked(self, body: bytes | None, headers_phase: bool = False) -> Iterator[Any]:
        request_id = self._request_id or b"-"
        result = self._picker.pick(self._path or "/", body, request_id, self._subset)
        if isinstance(result, Refusal):
            yield self._refused(result)
            return
        self.pick = result
        self._count("picked")
        e = self._p.ext_proc
        headers = [self._header(DESTINATION, result.endpoint)]
        metadata = self._p.struct.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: result.endpoint}})
        mutation = e.HeaderMutation(set_headers=headers)
        if headers_phase:
            yield e.ProcessingResponse(
                request_headers=e.HeadersResponse(response=e.CommonResponse(
                    header_mutation=mutation, clear_route_cache=True)),
                dynamic_metadata=metadata,
            )
        elif self._modes.request_full_duplex:
            assert body is not None
            headers.append(self._header("content-length", str(len(body))))
            mutation = e.HeaderMutation(set_headers=headers)
            yield e.ProcessingResponse(
                request_headers=e.HeadersResponse(response=e.CommonResponse(
                    header_mutation=mutation, clear_route_cache=True)),
                dynamic_metadata=metadata,
            )
            last = max(0, len(body) - 1) // BODY_PIECE_BYTES * BODY_PIECE_BYTES
            for start in range(0, last + 1, BODY_PIECE_BYTES):
                streamed = e.StreamedBodyResponse(
                    body=body[start:start + BODY_PIECE_BYTES], end_of_stream=start == last)
                yield self._msg(request_body=e.BodyResponse(response=e.CommonResponse(
                    body_mutation=e.BodyMutation(streamed_response=streamed))))
        else:
            yield e.ProcessingResponse(
                request_body=e.BodyResponse(response=e.CommonResponse(
                    header_mutation=mutation, clear_route_cache=True)),
                dynamic_metadata=metadata,
            )

    # --- the response --------------------------------------------------------------------

    def _response_headers(self, headers: Any) -> Iterator[Any]:
        status = 0
        for h in headers.headers.headers:
            if h.key == ":status":
                status = int(_value(h) or 0)
        if self.pick is not None:
            self.pick.response_started(status)
        yield self._msg(response_headers=self._p.ext_proc.HeadersResponse())
        if headers.end_of_stream:
            self.close()

    def _response_body(self, body: Any) -> Iterator[Any]:
        if self.pick is not None:
            self.pick.response_body(body.body)
        e = self._p.ext_proc
        if self._modes.response_full_duplex:
            streamed = e.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
            yield self._msg(response_body=e.BodyResponse(response=e.CommonResponse(
                body_mutation=e.BodyMutation(streamed_response=streamed))))
        else:
            yield self._msg(response_body=e.BodyResponse())
        if body.end_of_stream:
            self.close()

    # --- pieces --------------------------------------------------------------------------

    def _take_modes(self, config: Any) -> None:
        m = self._p.mode.ProcessingMode
        request = {
            m.FULL_DUPLEX_STREAMED: _Body.FULL_DUPLEX,
            m.STREAMED: _Body.STREAMED,
            m.NONE: _Body.NONE,
        }.get(config.request_body_mode, _Body.BUFFERED)  # BUFFERED, BUFFERED_PARTIAL
        self._modes = _Modes(request, config.response_body_mode == m.FULL_DUPLEX_STREAMED)

    def _take_metadata(self, metadata: Any) -> None:
        filters = metadata.filter_metadata
        if SUBSET_NAMESPACE in filters:
            fields = filters[SUBSET_NAMESPACE].fields
            if SUBSET in fields:
                self._subset = _subset_of(fields[SUBSET])
        if LB_NAMESPACE in filters and self.pick is not None:
            fields = filters[LB_NAMESPACE].fields
            if SERVED in fields:
                served = fields[SERVED].string_value
                if served and served != self.pick.endpoint:
                    self._count("served_elsewhere")
                    log.info("endpoint_served_elsewhere", picked=self.pick.endpoint,
                             served=served)

    def _refused(self, refused: Refusal) -> Any:
        e = self._p.ext_proc
        self.ended = True
        self._count(str(refused.status))
        content_type = self._header("content-type", "application/json")
        immediate = e.ImmediateResponse(
            status=self._p.http_status.HttpStatus(code=refused.status),
            headers=e.HeaderMutation(set_headers=[content_type]),
            body=refused.error().body(),
            details=f"kvsidecar_epp_{refused.status}",
        )
        return self._msg(immediate_response=immediate)

    def _header(self, key: str, value: str) -> Any:
        core = self._p.core
        return core.HeaderValueOption(header=core.HeaderValue(key=key, raw_value=value.encode()))

    def _msg(self, **fields: Any) -> Any:
        return self._p.ext_proc.ProcessingResponse(**fields)

    def _count(self, outcome: str) -> None:
        self._counts[outcome] = self._counts.get(outcome, 0) + 1


def _subset_of(value: Any) -> list[str]:
    """The endpoints of a subset hint: a list of ``ip:port`` strings, or one string of them
    separated by commas, or a list of such strings (anything else: none)."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        texts = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        texts = [value.string_value]
    else:
        texts = []
    return [e for text in texts for part in text.split(",") if (e := part.strip())]


def _value(header: Any) -> str:
    raw: bytes = header.raw_value
    return raw.decode(errors="replace") if raw else str(header.value)
