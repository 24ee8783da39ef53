"""The request proxy: gateway requests to the engine, through the adapter, with accounting.

``POST /v1/kvsidecar/generate`` takes a ``TokenizedRequest`` (JSON; the gateway has already
tokenized and placed it) and answers in OpenAI's shape: one JSON body, or SSE chunks passed
through as the engine produces them. A request that carries the client's OpenAI body (fields
token ids cannot carry) goes to the engine's own OpenAI server, and its answer is relayed as
the engine wrote it (its tool calls, reasoning, logprobs), errors in OpenAI's shape.

Each answered request tells the silence detector (``sidecar.health``) whether the engine
provably stored new blocks for it: the cached tokens it reported against the prompt's
cacheable blocks, or, when it reports none, whether the prompt's blocks are new here.

A client that disconnects cancels the handler (the app runs with ``handler_cancellation``),
which closes the engine connection: the engine aborts the request. Engine errors come back
OpenAI-shaped with the engine's status.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import orjson
import structlog
from aiohttp import web

from adapters.base import AdapterError, EngineAdapter, ResponseTranslator
from kvcore import BlockHasher, namespace_seed
from kvcore.errors import (
    ENDPOINT_REFUSED,
    ENGINE_UNREACHABLE,
    SERVICE_UNAVAILABLE,
    OpenAIError,
    route_missing,
)
from kvcore.requests import TokenizedRequest
from sidecar.health import SilenceDetector, cacheable_tokens
from sidecar.kv_move import PULL_HEADER, PrefixPuller
from sidecar.load import LoadTracker

__all__ = ["RequestProxy", "openai_error_response", "sse"]

log = structlog.get_logger(component="proxy")
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class _CacheReport:
    """What the engine said it found cached of one request's prompt (for the silence
    detector)."""

    translator: ResponseTranslator | None = None
    usage_cached_tokens: int | None = None  # a relayed OpenAI body's usage

    def cached_tokens(self) -> int | None:
        if self.usage_cached_tokens is not None:
            return self.usage_cached_tokens
        return None if self.translator is None else self.translator.cached_tokens()


def openai_error_response(error: OpenAIError, request_id: str | None = None) -> web.Response:
    headers = {"x-request-id": request_id} if request_id else None
    return web.json_response(
        error.to_dict(), status=error.status, headers=headers,
        dumps=lambda o: orjson.dumps(o).decode(),
    )


class RequestProxy:
    """Forwards tokenized requests to the engine and keeps the load figures."""

    def __init__(
        self,
        adapter: EngineAdapter,
        session: aiohttp.ClientSession,
        load: LoadTracker,
        silence: SilenceDetector,
        *,
        engine_url: str,
        model_id: str,
        worker_ids: tuple[str, ...],
        upstream_timeout_s: float,
        observe_latency: Callable[[float], None] | None = None,
        puller: PrefixPuller | None = None,
    ) -> None:
        """``puller``: brings a moved prefix here before the engine runs the request
        (``sidecar.kv_move``; None: no store, every move is a recompute)."""
        self._adapter = adapter
        self.puller = puller or PrefixPuller(None)
        self._session = session
        self._load = load
        self._silence = silence
        self._engine_url = engine_url.rstrip("/")
        self._worker_ids = worker_ids
        self._model_id = model_id
        self._hasher = BlockHasher(load.block_size)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=upstream_timeout_s)
        self._observe = observe_latency
        self.accepting = True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id")
        if not self.accepting:
            return openai_error_response(
                OpenAIError(503, "sidecar is draining", code=SERVICE_UNAVAILABLE), request_id
            )
        try:
            tokenized = msgspec.json.decode(await request.read(), type=TokenizedRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return openai_error_response(
                OpenAIError(400, f"invalid tokenized request: {exc}"), request_id
            )
        if tokenized.handoff is not None:
            return openai_error_response(
                OpenAIError(400, "a request with 'handoff' goes to /v1/kvsidecar/pd/generate"),
                request_id,
            )
        if request_id and request_id != tokenized.request_id:
            tokenized = msgspec.structs.replace(tokenized, request_id=request_id)
        worker_id = self._worker_for(tokenized)
        if worker_id is None:
            return openai_error_response(
                OpenAIError(
                    400,
                    f"dp_rank {tokenized.dp_rank} is out of range "
                    f"(this engine has {len(self._worker_ids)})",
                ),
                tokenized.request_id,
            )
        engine_view = tokenized.for_engine()  # a continuation: prompt and output so far
        try:
            native = self._adapter.translate_request(engine_view)
        except ValueError as exc:
            return openai_error_response(OpenAIError(400, str(exc)), tokenized.request_id)
        self._load.start(tokenized.request_id, worker_id, len(engine_view.prompt_token_ids))
        started_s = self._silence.now()
        started = time.perf_counter()
        report = _CacheReport()
        ok = False
        try:
            headers = {"x-request-id": tokenized.request_id}
            source = tokenized.prefix_source
            if source is not None:  # a moved prefix: here before the engine prefills
                moved = await self.puller.pull(source, tokenized.request_id)
                headers[PULL_HEADER] = moved.header()
            response = await self._forward(
                request, tokenized, native.path, native.body, native.stream, native.openai,
                worker_id, report=report, engine_headers=native.headers, headers=headers,
            )
            ok = response.status < 400
            return response
        finally:
            self._load.finish(tokenized.request_id, ok)
            if ok:
                stored = self._stored_new(engine_view, report.cached_tokens())
                self._silence.on_served(started_s, stored)
            if self._observe is not None:
                self._observe(time.perf_counter() - started)

    async def _forward(
        self,
        request: web.Request,
        tokenized: TokenizedRequest,
        path: str,
        body: dict[str, Any],
        stream: bool,
        openai: bool = False,
        worker_id: str = "",
        *,
        report: _CacheReport,
        engine_headers: Mapping[str, str] | None = None,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """``engine_headers``: the adapter's own for this request (e.g. vLLM's target DP
        rank), sent to the engine alongside ours; ``headers``: those of our answer."""
        rid = tokenized.request_id
        translator = self._adapter.response_translator(tokenized)
        report.translator = translator
        try:
            async with self._session.post(
                self._engine_url + path,
                data=orjson.dumps(body),
                timeout=self._timeout,
                headers={
                    **(engine_headers or {}),
                    "Content-Type": "application/json",
                    "x-request-id": rid,
                },
            ) as upstream:
                if upstream.status != 200:
                    raw = await upstream.read()
                    error = (_refused(path, upstream.status, raw, worker_id) if openai
                             else None) or translator.error(upstream.status, raw)
                    return openai_error_response(error, rid)
                if openai:
                    return await self._relay(request, upstream, rid, headers, report)
                if not stream:
                    answer = translator.response(orjson.loads(await upstream.read()))
                    self._load.tokens(rid, _completion_tokens(answer))
                    return web.json_response(
                        answer, headers=headers, dumps=lambda o: orjson.dumps(o).decode()
                    )
                return await self._stream(request, upstream, translator, rid, headers,
                                          tokenized.stream_token_ids)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("engine_request_failed", request_id=rid, error=repr(exc))
            return openai_error_response(
                OpenAIError(
                    502, f"engine at {self._engine_url} failed: {exc!r}", code=ENGINE_UNREACHABLE
                ),
                rid,
            )

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        translator: Any,
        rid: str,
        headers: dict[str, str],
        with_ids: bool,
    ) -> web.StreamResponse:
        """The engine's stream as OpenAI chunks; ``with_ids``: each write led by an SSE
        comment of the output token ids it carries (``: kvs-ids 1,2``). An engine that
        fails mid-stream cuts the connection, as its own death would: the client (the
        gateway) must not take a cut stream for a whole one."""
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            async for raw in upstream.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    log.warning("engine_chunk_invalid", request_id=rid, head=payload[:64])
                    continue
                chunks = translator.chunk(data)
                if chunks:
                    self._load.tokens(rid, 1)
                    out = b"".join(sse(c) for c in chunks)
                    if with_ids and (ids := translator.token_ids()) is not None:
                        out = ids_comment(ids) + out
                    await response.write(out)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine_stream_lost", request_id=rid, error=repr(exc))
            if request.transport is not None:
                request.transport.abort()
            return response
        tail = translator.finish()
        await response.write(b"".join(sse(c) for c in tail) + _SSE_DONE)
        await response.write_eof()
        return response

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        rid: str,
        headers: dict[str, str],
        report: _CacheReport,
    ) -> web.StreamResponse:
        """The engine's OpenAI answer, byte for byte (SSE events counted as tokens; a stream's
        cached tokens are not read, so the detector falls back to the prompt's novelty)."""
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            raw = await upstream.read()
            usage = _usage_of(raw)
            self._load.tokens(rid, _usage_completion_tokens(usage))
            report.usage_cached_tokens = _cached_tokens(usage)
            return web.Response(body=raw, headers={**headers, "Content-Type": content_type})
        response = web.StreamResponse(
            headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        async for piece in upstream.content.iter_any():
            events = piece.count(b"data:")
            if events:
                self._load.tokens(rid, events)
            await response.write(piece)
        await response.write_eof()
        return response

    async def render_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/kvsidecar/tokenize`` ``{"messages": [...]}``: the token ids the engine
        makes of a conversation, for the gateway's hash parity check (501: it cannot say)."""
        try:
            body = await request.json(loads=orjson.loads)
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError("messages must be a list")
        except (ValueError, KeyError, TypeError) as exc:
            return openai_error_response(OpenAIError(400, f"expected {{'messages': [...]}}: "
                                                     f"{exc}"))
        try:
            tokens = await self._adapter.render_tokens(messages)
        except AdapterError as exc:
            return openai_error_response(OpenAIError(502, str(exc), code=ENGINE_UNREACHABLE))
        if tokens is None:
            return openai_error_response(OpenAIError(
                501, f"the {self._adapter.kind.value} engine cannot tokenize a conversation",
                code="not_implemented"))
        return web.Response(body=orjson.dumps({"tokens": tokens}),
                            content_type="application/json")

    def _worker_for(self, tokenized: TokenizedRequest) -> str | None:
        rank = tokenized.dp_rank or 0
        return self._worker_ids[rank] if 0 <= rank < len(self._worker_ids) else None

    def _stored_new(self, engine_view: TokenizedRequest, cached_tokens: int | None) -> bool:
        """Whether the engine provably stored new blocks for this prompt (as it was sent):
        it found fewer tokens cached than the prompt's cacheable blocks, or, reporting
        none, the prompt's cacheable blocks were never seen on this worker."""
        tokens = engine_view.prompt_token_ids
        cacheable = cacheable_tokens(len(tokens), self._hasher.block_size)
        if cacheable == 0:
            return False
        if cached_tokens is not None:
            return cached_tokens < cacheable
        seed = namespace_seed(self._model_id, engine_view.lora_name, engine_view.cache_salt)
        return self._silence.first_seen(self._hasher.hash_tokens(tokens[:cacheable], seed)[-1])


def _refused(path: str, status: int, raw: bytes, worker_id: str) -> OpenAIError | None:
    """The refusal of a route the engine's OpenAI server does not have (its framework's
    bare 404), naming the route and the worker; None for any other error."""
    if not route_missing(status, raw):
        return None
    return OpenAIError(
        404, f"worker {worker_id}'s engine does not serve POST {path} (it answered {status})",
        code=ENDPOINT_REFUSED)


def sse(chunk: dict[str, Any]) -> bytes:
    """One SSE event of an OpenAI chunk."""
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def ids_comment(ids: list[int]) -> bytes:
    """The SSE comment line that says which output tokens the next event carries."""
    return b": kvs-ids " + ",".join(map(str, ids)).encode() + b"\n"


def _usage_of(raw: bytes) -> dict[str, Any]:
    """The ``usage`` object of a relayed OpenAI body ({} when it has none)."""
    try:
        usage = orjson.loads(raw).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    return usage if isinstance(usage, dict) else {}


def _usage_completion_tokens(usage: dict[str, Any]) -> int:
    try:
        return _completion_tokens({"usage": usage})
    except (TypeError, ValueError):
        return 1


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _completion_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    return int(usage.get("completion_tokens") or 1)
