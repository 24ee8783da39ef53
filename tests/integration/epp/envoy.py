"""The Envoy side of an ``ext_proc`` stream, built from Envoy's own generated messages
(``xds-protos``): what Envoy's ext_proc filter sends the endpoint picker for one HTTP request,
in the order it sends it, and what it reads back.

``EnvoyStream`` drives one bidirectional ``Process`` stream; ``forward`` sends the request
where the picker said, as Envoy's ORIGINAL_DST cluster would, and streams the response back
through the picker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

__all__ = ["BUFFERED", "FULL_DUPLEX", "STREAMED", "EnvoyStream", "Picked", "forward",
           "headers_of"]

FULL_DUPLEX = mode.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = mode.ProcessingMode.BUFFERED
STREAMED = mode.ProcessingMode.STREAMED
DESTINATION = "x-gateway-destination-endpoint"


def _header_map(pairs: list[tuple[str, str]]) -> Any:
    return core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in pairs])


def headers_of(mutation: Any) -> dict[str, str]:
    """The headers a ``HeaderMutation`` sets."""
    return {o.header.key: (o.header.raw_value.decode() or o.header.value)
            for o in mutation.set_headers}


@dataclass
class Picked:
    """What Envoy learned from the request phase."""

    header: str | None  # x-gateway-destination-endpoint, from the header mutation
    metadata: str | None  # envoy.lb / x-gateway-destination-endpoint, from dynamic metadata
    body: bytes  # the body Envoy sends upstream
    headers: dict[str, str] = field(default_factory=dict)  # every header the picker set
    immediate: Any = None  # an ImmediateResponse instead of a pick
    clear_route_cache: bool = False  # set on the answer carrying the pick
    pieces: list[int] = field(default_factory=list)  # sizes of the body sent back, full duplex

    @property
    def endpoint(self) -> str:
        assert self.immediate is None, f"no pick: {self.immediate}"
        assert self.header is not None and self.header == self.metadata, (self.header,
                                                                         self.metadata)
        return self.header


class EnvoyStream:
    """One ``Process`` stream, as Envoy's ext_proc filter runs it for one HTTP request."""

    def __init__(self, channel: grpc.aio.Channel, body_mode: int = FULL_DUPLEX,
                 subset: list[str] | str | None = None, send_protocol_config: bool = True
                 ) -> None:
        self._call = ep_grpc.ExternalProcessorStub(channel).Process()
        self.body_mode = body_mode
        self.subset = subset
        self.send_protocol_config = send_protocol_config
        self.picked: Picked | None = None

    async def _read(self) -> Any:
        msg = await self._call.read()
        assert msg is not grpc.aio.EOF, "the picker closed the stream"
        return msg

    async def request(self, path: str, body: bytes | None, request_id: str,
                      chunks: int = 3, method: str = "POST") -> Picked:
        """Send the request phase (headers, then the body in ``chunks`` pieces); return what
        the picker answered."""
        first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
            headers=_header_map([(":method", method), (":path", path),
                                 (":authority", "gateway.example"), (":scheme", "http"),
                                 ("content-type", "application/json"),
                                 ("x-request-id", request_id)]
                                + ([("content-length", str(len(body)))] if body else [])),
            end_of_stream=body is None))
        if self.send_protocol_config:  # Envoy sends it on the stream's first message
            first.protocol_config.CopyFrom(ep.ProtocolConfiguration(
                request_body_mode=self.body_mode, response_body_mode=self.body_mode))
        if self.subset is not None:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": self.subset})
            first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        await self._call.write(first)
        if body is None:
            return await self._headers_answer(b"")
        if self.body_mode == BUFFERED:
            # Envoy waits for the headers' answer, then sends the buffered body whole.
            answer = await self._read()
            if answer.HasField("immediate_response"):
                return self._immediate(answer)
            assert answer.HasField("request_headers"), answer
            await self._call.write(ep.ProcessingRequest(
                request_body=ep.HttpBody(body=body, end_of_stream=True)))
            answer = await self._read()
            if answer.HasField("immediate_response"):
                return self._immediate(answer)
            assert answer.HasField("request_body"), answer
            common = answer.request_body.response
            mutation = common.header_mutation
            self.picked = Picked(headers_of(mutation).get(DESTINATION),
                                 _metadata(answer), body, headers_of(mutation),
                                 clear_route_cache=common.clear_route_cache)
            return self.picked
        if self.body_mode == STREAMED:
            # Envoy waits for the headers' answer, then sends each chunk and waits for its.
            picked = await self._headers_answer(body)
            if picked.immediate is not None:
                return picked
            pieces = _pieces(body, chunks)
            for k, piece in enumerate(pieces):
                await self._call.write(ep.ProcessingRequest(
                    request_body=ep.HttpBody(body=piece, end_of_stream=k == len(pieces) - 1)))
                answer = await self._read()
                assert answer.HasField("request_body"), answer
            return picked
        pieces = _pieces(body, chunks)
        for k, piece in enumerate(pieces):  # full duplex: sent without waiting
            await self._call.write(ep.ProcessingRequest(
                request_body=ep.HttpBody(body=piece, end_of_stream=k == len(pieces) - 1)))
        picked = await self._headers_answer(body)
        if picked.immediate is not None:
            return picked
        sent = b""
        while True:  # the body comes back as streamed body responses, until end_of_stream
            answer = await self._read()
            assert answer.HasField("request_body"), answer
            streamed = answer.request_body.response.body_mutation.streamed_response
            sent += streamed.body
            picked.pieces.append(len(streamed.body))
            if streamed.end_of_stream:
                break
        picked.body = sent
        return picked

    async def _headers_answer(self, body: bytes) -> Picked:
        answer = await self._read()
        if answer.HasField("immediate_response"):
            return self._immediate(answer)
        assert answer.HasField("request_headers"), answer
        common = answer.request_headers.response
        mutation = common.header_mutation
        self.picked = Picked(headers_of(mutation).get(DESTINATION), _metadata(answer), body,
                             headers_of(mutation), clear_route_cache=common.clear_route_cache)
        return self.picked

    def _immediate(self, answer: Any) -> Picked:
        self.picked = Picked(None, None, b"", immediate=answer.immediate_response)
        return self.picked

    async def response(self, status: int, content_type: str, chunks: list[bytes]) -> bytes:
        """Send the response phase as Envoy relays it; returns the body Envoy would send the
        client (what the picker streamed back)."""
        last = not chunks
        await self._call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders(
            headers=_header_map([(":status", str(status)), ("content-type", content_type)]),
            end_of_stream=last)))
        answer = await self._read()
        assert answer.HasField("response_headers"), answer
        out = b""
        for k, chunk in enumerate(chunks):
            eos = k == len(chunks) - 1
            await self._call.write(ep.ProcessingRequest(
                response_body=ep.HttpBody(body=chunk, end_of_stream=eos)))
            if self.body_mode == FULL_DUPLEX:
                answer = await self._read()
                streamed = answer.response_body.response.body_mutation.streamed_response
                assert streamed.end_of_stream == eos
                out += streamed.body
            else:
                answer = await self._read()
                assert answer.HasField("response_body"), answer
                out += chunk
        return out

    async def close(self) -> None:
        """Envoy is done with the request: it half-closes; the picker ends the stream."""
        await self._call.done_writing()
        assert await self._call.read() is grpc.aio.EOF
        assert await self._call.code() == grpc.StatusCode.OK

    def cancel(self) -> None:
        self._call.cancel()


def _pieces(body: bytes, chunks: int) -> list[bytes]:
    size = max(1, -(-len(body) // chunks))
    return [body[i:i + size] for i in range(0, len(body), size)] or [b""]


def _metadata(answer: Any) -> str | None:
    fields = answer.dynamic_metadata.fields
    if "envoy.lb" not in fields:
        return None
    lb = fields["envoy.lb"].struct_value.fields
    return lb[DESTINATION].string_value if DESTINATION in lb else None


async def forward(session: aiohttp.ClientSession, stream: EnvoyStream, path: str,
                  picked: Picked) -> tuple[int, bytes]:
    """Send the request to the picked endpoint, as Envoy would, and its response back
    through the picker; returns the status and the body the client gets."""
    url = f"http://{picked.endpoint}{path}"
    headers = {"content-type": "application/json"}
    async with session.post(url, data=picked.body, headers=headers) as resp:
        chunks = [chunk async for chunk in resp.content.iter_any()]
        content_type = resp.headers.get("content-type", "")
        status = resp.status
    body = await stream.response(status, content_type, chunks)
    return status, body
