"""Prefill/decode disaggregation on the sidecars: the prefill leg, the handoff, the decode leg.

The gateway sends a disaggregated request to the chosen *decode* worker's sidecar with a
``Handoff`` naming the chosen prefill sidecar (the llm-d shape: the decode side's sidecar
drives the prefill)::

    gateway ──POST /v1/kvsidecar/pd/generate──▶ decode sidecar
      decode sidecar ──POST /v1/kvsidecar/pd/prefill──▶ prefill sidecar ──▶ prefill engine
          ◀── the first token and the prompt's handoff keys (the engine exported its KV)
      decode sidecar: KvHandoff.pull(prefill sidecar, store keys)         (pd_handoff.py)
      decode sidecar ──decode leg: prompt + [first], the rest of max_tokens──▶ decode engine
          the engine imports the KV through its hook and decodes on
      ◀── one OpenAI stream: the prefill's first token, then the decode engine's tokens

What each leg looks like on the wire is the engine adapter's (``EngineAdapter.pd``,
``adapters.base.PrefillDecode``); an adapter without one answers 501 here.

Nothing is sent to the gateway before the decode engine has imported the KV and answered its
first chunk, so a failed or timed-out handoff is a clean error (502, code
``kv_transfer_failed``) that the gateway can re-run aggregated elsewhere. With
``early_first_token`` (the gateway has no fallback) the prefill's token is streamed at once
and a failed handoff ends the stream with an error event of the same code.

``GET /v1/kvsidecar/pd/info`` tells an operator this worker's role, its handoff kind and
counts, and where its engine serves its own PD transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import orjson
import structlog
from aiohttp import web

from adapters.base import EngineAdapter, PrefillDecode, PrefillResult, ResponseTranslator
from kvcore.errors import ENGINE_UNREACHABLE, OpenAIError
from kvcore.requests import TRANSFER_FAILED, Handoff, TokenizedRequest
from sidecar.load import LoadTracker
from sidecar.pd_handoff import HandoffError, KvHandoff
from sidecar.proxy import openai_error_response, sse

__all__ = ["PdRoutes"]

log = structlog.get_logger(component="disagg")

_SSE_DONE = b"data: [DONE]\n\n"


class _EngineRefusedError(Exception):
    """The decode engine answered an error (``import_failed``: it could not import the KV)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _message_of(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except orjson.JSONDecodeError:
        pass
    return raw[:200].decode(errors="replace")


def _error(status: int, message: str, code: str | None, rid: str) -> web.Response:
    return openai_error_response(OpenAIError(status, message, code=code), rid)


class PdRoutes:
    """The disaggregation routes of one sidecar (both roles serve ``/info``)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        engine_session: aiohttp.ClientSession,
        peer_session: aiohttp.ClientSession,
        load: LoadTracker,
        handoff: KvHandoff,
        *,
        engine_url: str,
        worker_ids: tuple[str, ...],
        role: str,
        bootstrap: dict[str, Any] | None,
        timeout_s: float,
    ) -> None:
        self._adapter = adapter
        self._engine_session = engine_session  # carries the engine's credential
        self._peer_session = peer_session  # to the prefill sidecar: no engine credential
        self._load = load
        self._handoff = handoff
        self._engine_url = engine_url.rstrip("/")
        self._worker_ids = worker_ids
        self.role = role
        self._bootstrap = bootstrap
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=timeout_s)
        self.handoffs = 0
        self.handoff_failures = 0
        self.handoff_seconds = 0.0

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/kvsidecar/pd/info", self._info),
            web.post("/v1/kvsidecar/pd/prefill", self._prefill),
            web.post("/v1/kvsidecar/pd/generate", self._generate),
        ]

    # --- info ---------------------------------------------------------------------------

    async def _info(self, request: web.Request) -> web.Response:
        bootstrap = self._bootstrap or {}
        body = {
            "role": self.role,
            "bootstrap_host": bootstrap.get("host"),
            "bootstrap_port": bootstrap.get("port"),
            "handoff": self._handoff.kind.value,
            "handoffs": self.handoffs,
            "handoff_failures": self.handoff_failures,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # --- the legs' common entry -----------------------------------------------------------

    async def _accept(
        self, request: web.Request, role: str
    ) -> tuple[TokenizedRequest, PrefillDecode, str, str] | web.Response:
        """The request of one leg, checked: (request, the engine's PD, worker id, request id),
        or the error to answer."""
        rid = request.headers.get("x-request-id", "")
        if self.role != role:
            return _error(409, f"this sidecar's role is {self.role}, not {role}",
                          "wrong_role", rid)
        pd = self._adapter.pd
        if pd is None:
            return _error(501, f"the {self._adapter.kind.value} adapter cannot split a request "
                          "into prefill and decode legs", "not_implemented", rid)
        try:
            tokenized = msgspec.json.decode(await request.read(), type=TokenizedRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, f"invalid disaggregated request: {exc}", None, rid)
        rid = rid or tokenized.request_id
        worker_id = self._worker(tokenized.dp_rank)
        if worker_id is None:
            return _error(400, f"dp_rank {tokenized.dp_rank} is out of range", None, rid)
        return msgspec.structs.replace(tokenized, request_id=rid), pd, worker_id, rid

    # --- the prefill leg ----------------------------------------------------------------

    async def _prefill(self, request: web.Request) -> web.Response:
        accepted = await self._accept(request, "prefill")
        if isinstance(accepted, web.Response):
            return accepted
        tokenized, pd, worker_id, rid = accepted
        try:
            native = pd.prefill_request(tokenized)
        except ValueError as exc:
            return _error(400, str(exc), None, rid)
        self._load.start(rid, worker_id, len(tokenized.prompt_token_ids))
        started = time.perf_counter()
        ok = False
        try:
            async with self._engine_session.post(
                self._engine_url + native.path, data=orjson.dumps(native.body),
                timeout=self._timeout,
                headers={**native.headers, "Content-Type": "application/json"},
            ) as upstream:
                raw = await upstream.read()
                if upstream.status != 200:
                    translator = self._adapter.response_translator(tokenized)
                    return openai_error_response(translator.error(upstream.status, raw), rid)
            result = pd.prefill_result(tokenized, orjson.loads(raw),
                                       time.perf_counter() - started)
            self._load.tokens(rid, len(result.output_ids))
            ok = True
            return web.Response(body=msgspec.json.encode(result), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return _error(502, f"prefill engine at {self._engine_url} failed: {exc!r}",
                          ENGINE_UNREACHABLE, rid)
        finally:
            self._load.finish(rid, ok)

    # --- the decode leg -----------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        accepted = await self._accept(request, "decode")
        if isinstance(accepted, web.Response):
            return accepted
        tokenized, pd, worker_id, rid = accepted
        spec = tokenized.handoff
        if spec is None:
            return _error(400, "a disaggregated request needs 'handoff' (the prefill side)",
                          None, rid)
        self._load.start(rid, worker_id, len(tokenized.prompt_token_ids))
        ok = False
        try:
            response = await self._run(request, tokenized, pd, spec, rid)
            ok = response.status < 400
            return response
        finally:
            self._load.finish(rid, ok)

    async def _run(
        self, request: web.Request, tokenized: TokenizedRequest, pd: PrefillDecode,
        spec: Handoff, rid: str,
    ) -> web.StreamResponse:
        prefill = await self._call_prefill(tokenized, spec, rid)
        if isinstance(prefill, web.Response):
            return prefill
        translator = self._adapter.response_translator(tokenized)
        first = pd.first_object(tokenized, prefill)
        if prefill.finished:
            return await self._answer(request, tokenized, translator, [first], rid)
        self._load.tokens(rid, 1)
        early: web.StreamResponse | None = None
        if spec.early_first_token and tokenized.stream:
            early = await self._open_stream(request, rid)  # the first token goes out now
            await early.write(b"".join(sse(c) for c in translator.chunk(first)))
        outcome = await self._handoff_then_decode(tokenized, pd, spec, prefill, rid)
        if isinstance(outcome, web.Response):
            if early is None:
                return outcome
            await early.write(sse(orjson.loads(outcome.body)) + _SSE_DONE)  # type: ignore[arg-type]
            await early.write_eof()
            return early
        chunks = pd.stitched(tokenized, prefill, *outcome)
        if early is None:
            return await self._answer(request, tokenized, translator, chunks, rid, first)
        await self._write_stream(early, translator, chunks, rid)
        return early

    async def _handoff_then_decode(
        self, tokenized: TokenizedRequest, pd: PrefillDecode, spec: Handoff,
        prefill: PrefillResult, rid: str,
    ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]] | web.Response:
        """Pull the KV, start the decode engine; its first object and the rest, or the error
        to answer (``kv_transfer_failed`` when the KV did not arrive)."""
        keys = prefill.handoff_keys
        try:
            async with asyncio.timeout(spec.transfer_timeout_s):
                moved = await self._handoff.pull(
                    spec.prefill_url, keys, transport=spec.transport,
                    timeout_s=spec.transfer_timeout_s,
                )
                stream = self._decode_stream(pd, tokenized, prefill, rid)
                head = await anext(stream)  # the engine imported the KV and decoded once
        except HandoffError as exc:
            return self._transfer_failed(str(exc), rid)
        except TimeoutError:
            return self._transfer_failed(
                f"the handoff of {len(keys)} pages did not complete within "
                f"{spec.transfer_timeout_s:g}s", rid)
        except _EngineRefusedError as exc:
            if pd.import_failed(exc.status):
                return self._transfer_failed(exc.message, rid)
            return openai_error_response(OpenAIError(exc.status, exc.message), rid)
        self.handoffs += 1
        self.handoff_seconds += moved.seconds
        log.debug("kv_handoff_completed", request_id=rid, pages=moved.blocks,
                  transport=moved.transport, seconds=round(moved.seconds, 6))
        return head, stream

    async def _call_prefill(
        self, tokenized: TokenizedRequest, spec: Handoff, rid: str
    ) -> PrefillResult | web.Response:
        leg = msgspec.structs.replace(tokenized, dp_rank=spec.prefill_dp_rank, handoff=None)
        url = spec.prefill_url.rstrip("/") + "/v1/kvsidecar/pd/prefill"
        try:
            async with self._peer_session.post(
                url, data=msgspec.json.encode(leg), timeout=self._timeout,
                headers={"Content-Type": "application/json", "x-request-id": rid},
            ) as r:
                raw = await r.read()
                if r.status != 200:
                    return web.Response(body=raw, status=r.status,
                                        content_type="application/json")
            return msgspec.json.decode(raw, type=PrefillResult)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError,
                msgspec.ValidationError) as exc:
            return _error(502, f"prefill sidecar {spec.prefill_url} failed: {exc!r}",
                          "prefill_failed", rid)

    async def _decode_stream(
        self, pd: PrefillDecode, tokenized: TokenizedRequest, prefill: PrefillResult, rid: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The decode engine's native SSE objects (raises ``_EngineRefusedError`` on an
        error)."""
        native = pd.decode_request(tokenized, prefill)
        async with self._engine_session.post(
            self._engine_url + native.path, data=orjson.dumps(native.body),
            timeout=self._timeout,
            headers={**native.headers, "Content-Type": "application/json", "x-request-id": rid},
        ) as upstream:
            if upstream.status != 200:
                raw = await upstream.read()
                raise _EngineRefusedError(upstream.status, _message_of(raw))
            async for raw_line in upstream.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                data = orjson.loads(payload)
                if isinstance(data, dict) and "error" in data:
                    err = data["error"]
                    code = err.get("code") if isinstance(err, dict) else None
                    raise _EngineRefusedError(code if isinstance(code, int) else 500,
                                              _message_of(payload))
                yield data

    def _transfer_failed(self, message: str, rid: str) -> web.Response:
        self.handoff_failures += 1
        log.warning("kv_handoff_failed", request_id=rid, error=message)
        return _error(502, f"KV transfer failed: {message}", TRANSFER_FAILED, rid)

    async def _answer(
        self,
        request: web.Request,
        tokenized: TokenizedRequest,
        translator: ResponseTranslator,
        chunks: list[dict[str, Any]] | AsyncIterator[dict[str, Any]],
        rid: str,
        first: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """The client's answer from native objects, streamed or whole."""
        if not tokenized.stream:
            last = first
            if isinstance(chunks, list):
                last = chunks[-1]
            else:
                async for data in chunks:
                    last = data
            assert last is not None  # a list holds one object at least; else ``first``
            try:
                answer = translator.response(last)
            except OpenAIError as exc:
                return openai_error_response(exc, rid)
            return web.json_response(answer, headers={"x-request-id": rid},
                                     dumps=lambda o: orjson.dumps(o).decode())
        response = await self._open_stream(request, rid)
        if first is not None:
            await response.write(b"".join(sse(c) for c in translator.chunk(first)))
        await self._write_stream(response, translator, chunks, rid)
        return response

    async def _open_stream(self, request: web.Request, rid: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "x-request-id": rid, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def _write_stream(
        self,
        response: web.StreamResponse,
        translator: ResponseTranslator,
        chunks: list[dict[str, Any]] | AsyncIterator[dict[str, Any]],
        rid: str,
    ) -> None:
        """Native objects → OpenAI chunks on an open stream, then the tail and ``[DONE]``."""
        if isinstance(chunks, list):
            for data in chunks:
                await response.write(b"".join(sse(c) for c in translator.chunk(data)))
        else:
            async for data in chunks:
                out = translator.chunk(data)
                if out:
                    self._load.tokens(rid, 1)
                    await response.write(b"".join(sse(c) for c in out))
        tail = translator.finish()
        await response.write(b"".join(sse(c) for c in tail) + _SSE_DONE)
        await response.write_eof()

    def _worker(self, dp_rank: int | None) -> str | None:
        rank = dp_rank or 0
        return self._worker_ids[rank] if 0 <= rank < len(self._worker_ids) else None
