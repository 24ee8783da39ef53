"""Prefill/decode disaggregation on the sidecars: the prefill leg, the handoff, the decode leg.

The gateway sends a disaggregated request to the chosen *decode* worker's sidecar, naming the
chosen prefill sidecar (the llm-d shape: the decode side's sidecar drives the prefill)::

    gateway ──POST /v1/kvsidecar/pd/generate──▶ decode sidecar
      decode sidecar ──POST /v1/kvsidecar/pd/prefill──▶ prefill sidecar ──▶ prefill engine
          ◀── first token id + text, the prompt's page keys (engine exported them)
      decode sidecar: KvHandoff.pull(prefill sidecar, page keys)        (pd_handoff.py)
      decode sidecar ──/generate prompt+[first], max_tokens−1, kv_transfer──▶ decode engine
          engine imports the pages through its hook and decodes on
      ◀── one OpenAI stream: the prefill's first token, then the decode engine's tokens

Nothing is sent to the gateway before the decode engine has imported the pages and answered
its first chunk, so a failed or timed-out handoff is a clean error (502, code
``kv_transfer_failed``) that the gateway can re-run aggregated elsewhere. When the gateway
has no fallback (``early_first_token``), the prefill's token is streamed at once instead and
a failed handoff ends the stream with an error event of the same code.

The legs speak SGLang's native ``/generate`` (the reference engine's and SGLang's API): the
first token's id continues the prompt on the decode engine, so greedy and seeded sampling
continue exactly as an aggregated engine would. ``GET /v1/kvsidecar/pd/info`` tells the
gateway this worker's role, KV capacity (for the decode pool's free-capacity score) and, for
SGLang's native PD mode, its bootstrap address.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
import orjson
import structlog
from aiohttp import web

from adapters.base import EngineAdapter
from kvcore.errors import OpenAIError
from kvcore.requests import TokenizedRequest
from sidecar.load import LoadTracker
from sidecar.pd_handoff import HandoffError, KvHandoff
from sidecar.pd_stitch import (
    EngineRefusedError,
    PrefillResult,
    message_of,
    meta_info,
    sse,
    stitched,
)
from sidecar.proxy import openai_error_response

__all__ = ["PD_FIELD", "TRANSFER_FAILED", "PdRoutes"]

log = structlog.get_logger(component="disagg")

PD_FIELD = "kvsidecar_pd"  # the TokenizedRequest.extra key the gateway fills for a PD request
TRANSFER_FAILED = "kv_transfer_failed"  # error code of a failed handoff (the gateway's cue)
_SSE_DONE = b"data: [DONE]\n\n"


class _PdSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the gateway says about the prefill side of one request."""

    prefill_url: str
    prefill_dp_rank: int | None = None
    transport: str = "shm"
    transfer_timeout_s: float = 10.0
    # Stream the prefill's token before the handoff (lower TTFT); a failed handoff then ends
    # the stream with an error event instead of an error reply (no fallback possible).
    early_first_token: bool = False


def _error(status: int, message: str, type_: str, code: str | None, rid: str) -> web.Response:
    return openai_error_response(OpenAIError(status, message, type_, code=code), rid)


class PdRoutes:
    """The disaggregation routes of one sidecar (both roles serve ``/info``)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        session: aiohttp.ClientSession,
        load: LoadTracker,
        handoff: KvHandoff,
        *,
        engine_url: str,
        worker_ids: tuple[str, ...],
        role: str,
        bootstrap_port: int | None,
        timeout_s: float,
    ) -> None:
        self._adapter = adapter
        self._session = session
        self._load = load
        self._handoff = handoff
        self._engine_url = engine_url.rstrip("/")
        self._worker_ids = worker_ids
        self.role = role
        self._bootstrap_port = bootstrap_port
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
        capacity: int | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self._session.get(f"{self._engine_url}/server_info", timeout=timeout) as r:
                info = await r.json(content_type=None)
            tokens = info.get("max_total_num_tokens")
            page = info.get("page_size") or self._load.block_size
            if isinstance(tokens, int) and isinstance(page, int) and page > 0:
                capacity = tokens // page
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            capacity = None
        body = {
            "role": self.role,
            "capacity_blocks": capacity,
            "bootstrap_host": urlsplit(self._engine_url).hostname,
            "bootstrap_port": self._bootstrap_port,
            "handoff": self._handoff.kind.value,
            "handoffs": self.handoffs,
            "handoff_failures": self.handoff_failures,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # --- the prefill leg ----------------------------------------------------------------

    async def _prefill(self, request: web.Request) -> web.Response:
        rid = request.headers.get("x-request-id", "")
        if self.role != "prefill":
            return _error(409, f"this sidecar's role is {self.role}, not prefill",
                          "invalid_request_error", "wrong_role", rid)
        try:
            tokenized = msgspec.json.decode(await request.read(), type=TokenizedRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, f"invalid tokenized request: {exc}", "invalid_request_error",
                          None, rid)
        rid = rid or tokenized.request_id
        leg = msgspec.structs.replace(tokenized, request_id=rid, max_tokens=1, stream=False,
                                      include_usage=False)
        worker_id = self._worker(tokenized.dp_rank)
        if worker_id is None:
            return _error(400, f"dp_rank {tokenized.dp_rank} is out of range",
                          "invalid_request_error", None, rid)
        try:
            native = self._adapter.translate_request(leg)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error", None, rid)
        if native.path != "/generate":
            return _error(501, "prefill/decode handoff needs an engine with SGLang's /generate "
                          "API", "not_implemented", None, rid)
        self._load.start(rid, worker_id, len(tokenized.prompt_token_ids))
        started = time.perf_counter()
        ok = False
        try:
            async with self._session.post(
                self._engine_url + native.path, data=orjson.dumps(native.body),
                timeout=self._timeout, headers={"Content-Type": "application/json"},
            ) as upstream:
                raw = await upstream.read()
                if upstream.status != 200:
                    err = self._adapter.response_translator(leg).error(upstream.status, raw)
                    return openai_error_response(err, rid)
            body = orjson.loads(raw)
            meta = body.get("meta_info") or {}
            transfer = meta.get("kv_transfer") or {}
            result = PrefillResult(
                output_ids=[int(t) for t in body.get("output_ids") or []],
                text=str(body.get("text") or ""),
                finish_reason=meta.get("finish_reason"),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                page_keys=[str(k) for k in transfer.get("page_keys") or []],
                seconds=time.perf_counter() - started,
            )
            self._load.tokens(rid, len(result.output_ids))
            ok = True
            return web.Response(body=msgspec.json.encode(result), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return _error(502, f"prefill engine at {self._engine_url} failed: {exc!r}",
                          "engine_unreachable", None, rid)
        finally:
            self._load.finish(rid, ok)

    # --- the decode leg -----------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        if self.role != "decode":
            return _error(409, f"this sidecar's role is {self.role}, not decode",
                          "invalid_request_error", "wrong_role", rid)
        try:
            tokenized = msgspec.json.decode(await request.read(), type=TokenizedRequest)
            spec = msgspec.convert(tokenized.extra.get(PD_FIELD), _PdSpec)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, f"invalid disaggregated request: {exc}", "invalid_request_error",
                          None, rid)
        rid = rid or tokenized.request_id
        extra = {k: v for k, v in tokenized.extra.items() if k != PD_FIELD}
        tokenized = msgspec.structs.replace(tokenized, request_id=rid, extra=extra)
        worker_id = self._worker(tokenized.dp_rank)
        if worker_id is None:
            return _error(400, f"dp_rank {tokenized.dp_rank} is out of range",
                          "invalid_request_error", None, rid)
        self._load.start(rid, worker_id, len(tokenized.prompt_token_ids))
        ok = False
        try:
            response = await self._run(request, tokenized, spec, rid)
            ok = response.status < 400
            return response
        finally:
            self._load.finish(rid, ok)

    async def _run(
        self, request: web.Request, tokenized: TokenizedRequest, spec: _PdSpec, rid: str
    ) -> web.StreamResponse:
        prefill = await self._call_prefill(tokenized, spec, rid)
        if isinstance(prefill, web.Response):
            return prefill
        translator = self._adapter.response_translator(tokenized)
        first = {
            "text": prefill.text,
            "output_ids": prefill.output_ids,
            "meta_info": meta_info(tokenized, prefill, None, 0),
        }
        remaining = None if tokenized.max_tokens is None else tokenized.max_tokens - 1
        done = prefill.finish_reason is not None and remaining is not None and remaining <= 0
        if not done and prefill.finish_reason is not None:
            kind = prefill.finish_reason
            kind = kind.get("type") if isinstance(kind, Mapping) else kind
            done = kind != "length"  # the first token already ended it (EOS, stop)
        if done or not prefill.output_ids:
            first["meta_info"] = meta_info(tokenized, prefill, prefill.finish_reason, 0)
            return await self._answer(request, tokenized, translator, [first], rid)
        self._load.tokens(rid, 1)
        continuation = self._continuation(tokenized, prefill, remaining)
        early: web.StreamResponse | None = None
        if spec.early_first_token and tokenized.stream:
            early = await self._open_stream(request, rid)  # the first token goes out now
            await early.write(b"".join(sse(c) for c in translator.chunk(first)))
        outcome = await self._handoff_then_decode(spec, prefill, continuation, rid)
        if isinstance(outcome, web.Response):
            if early is None:
                return outcome
            await early.write(sse(orjson.loads(outcome.body)) + _SSE_DONE)  # type: ignore[arg-type]
            await early.write_eof()
            return early
        chunks = stitched(tokenized, prefill, *outcome)
        if early is None:
            return await self._answer(request, tokenized, translator, chunks, rid, first)
        await self._write_stream(early, translator, chunks, rid)
        return early

    async def _handoff_then_decode(
        self, spec: _PdSpec, prefill: PrefillResult, continuation: dict[str, Any], rid: str
    ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]] | web.Response:
        """Pull the pages, start the decode engine; its first object and the rest, or the
        error to answer (``kv_transfer_failed`` when the pages did not arrive)."""
        try:
            async with asyncio.timeout(spec.transfer_timeout_s):
                moved = await self._handoff.pull(
                    spec.prefill_url, prefill.page_keys, transport=spec.transport,
                    timeout_s=spec.transfer_timeout_s,
                )
                stream = self._decode_stream(continuation, rid)
                head = await anext(stream)  # the engine imported the pages and decoded once
        except HandoffError as exc:
            return self._transfer_failed(str(exc), rid)
        except TimeoutError:
            return self._transfer_failed(
                f"the handoff of {len(prefill.page_keys)} pages did not complete within "
                f"{spec.transfer_timeout_s:g}s", rid)
        except EngineRefusedError as exc:
            if exc.status == 409:  # the decode engine could not import the prompt's pages
                return self._transfer_failed(exc.message, rid)
            return openai_error_response(OpenAIError(exc.status, exc.message), rid)
        self.handoffs += 1
        self.handoff_seconds += moved.seconds
        log.debug("kv_handoff_completed", request_id=rid, pages=moved.blocks,
                  transport=moved.transport, seconds=round(moved.seconds, 6))
        return head, stream

    async def _call_prefill(
        self, tokenized: TokenizedRequest, spec: _PdSpec, rid: str
    ) -> PrefillResult | web.Response:
        leg = msgspec.structs.replace(tokenized, dp_rank=spec.prefill_dp_rank)
        url = spec.prefill_url.rstrip("/") + "/v1/kvsidecar/pd/prefill"
        try:
            async with self._session.post(
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
                          "bad_gateway", "prefill_failed", rid)

    def _continuation(
        self, tokenized: TokenizedRequest, prefill: PrefillResult, remaining: int | None
    ) -> dict[str, Any]:
        leg = msgspec.structs.replace(
            tokenized,
            prompt_token_ids=[*tokenized.prompt_token_ids, *prefill.output_ids],
            max_tokens=remaining,
            stream=True,
            extra={**tokenized.extra, "kv_transfer": {"page_keys": prefill.page_keys}},
        )
        return self._adapter.translate_request(leg).body

    async def _decode_stream(self, body: dict[str, Any], rid: str) -> AsyncIterator[dict[str, Any]]:
        """The decode engine's native SSE objects (raises ``EngineRefusedError`` on an error)."""
        async with self._session.post(
            self._engine_url + "/generate", data=orjson.dumps(body), timeout=self._timeout,
            headers={"Content-Type": "application/json", "x-request-id": rid},
        ) as upstream:
            if upstream.status != 200:
                raw = await upstream.read()
                raise EngineRefusedError(upstream.status, message_of(raw))
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
                    raise EngineRefusedError(code if isinstance(code, int) else 500,
                                         message_of(payload))
                yield data

    def _transfer_failed(self, message: str, rid: str) -> web.Response:
        self.handoff_failures += 1
        log.warning("kv_handoff_failed", request_id=rid, error=message)
        return _error(502, f"KV transfer failed: {message}", "bad_gateway", TRANSFER_FAILED, rid)

    async def _answer(
        self,
        request: web.Request,
        tokenized: TokenizedRequest,
        translator: Any,
        chunks: Any,
        rid: str,
        first: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """The client's answer from native objects (cumulative text), streamed or whole."""
        headers = {"x-request-id": rid}
        if not tokenized.stream:
            last = first
            if isinstance(chunks, list):
                last = chunks[-1]
            else:
                async for data in chunks:
                    last = data
            try:
                answer = translator.response(last)
            except OpenAIError as exc:
                return openai_error_response(exc, rid)
            return web.json_response(answer, headers=headers,
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
        self, response: web.StreamResponse, translator: Any, chunks: Any, rid: str
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
