"""The parse and prepare stages: a proxied HTTP request becomes an ``Exchange``, or an answer.

Parse (``routing.prompt.openai_api``), check the model, prepare (template, tokens, hashes:
``PromptPreparer``); a request that fails any of them is answered at once with an
OpenAI-shaped error and still finishes through its record (metrics, log line).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import orjson
import structlog

from kvcore.errors import MODEL_NOT_FOUND, RATE_LIMIT_EXCEEDED, Dialect, OpenAIError
from routing.http.server import HttpRequest, ServerConnection
from routing.pipeline.admission import (
    PRIORITY_HEADER,
    SHED_HEADER,
    SHED_RATE_LIMIT,
    parse_priority,
)
from routing.pipeline.context import PipelineContext
from routing.pipeline.exchange import Exchange
from routing.pipeline.legs import LegTarget
from routing.pipeline.pair import PdPairing
from routing.pipeline.record import RequestRecord
from routing.pipeline.sidecar_body import takes_token_path
from routing.pipeline.slo import SLO_ITL_HEADER, SLO_TTFT_HEADER, Slo, parse_slo
from routing.prompt.openai_api import Endpoint, OpenAIRequest, parse_request
from routing.prompt.preparer import PreparedPrompt
from routing.prompt.tokenizer import TokenizeLater

__all__ = ["SESSION_HEADER", "TenantAdmission", "admit", "check_model", "tenant_cache_salt"]

SESSION_HEADER = b"x-session-id"
log = structlog.get_logger("routing.pipeline", component="gateway")
# Uncached prompt text this long (about 2,000 tokens, a few ms of tokenizing) is tokenized in
# a worker thread; a pass that meets another such text tries again, at most this many times.
DEFER_CHARS = 8192
_DEFER_ATTEMPTS = 3


class TenantAdmission(Protocol):
    """The client's tenant (``routing.serve.auth.Tenant``): its cache salt and token budget."""

    name: str
    salt: str
    weight: float  # its share of a busy fleet (``routing.pipeline.admission``)

    def take_tokens(self, tokens: int) -> float: ...


class _OverTokenLimit(OpenAIError):
    def __init__(self, tenant: str, wait_s: float) -> None:
        super().__init__(
            429,
            f"tenant {tenant!r} is over its limit of tokens per second; retry after "
            f"{wait_s:.2f}s",
            code=RATE_LIMIT_EXCEEDED,
        )
        self.wait_s = wait_s


def admit(
    ctx: PipelineContext,
    conn: ServerConnection,
    request: HttpRequest,
    endpoint: Endpoint,
    key: str,
    request_id: bytes,
    tenant: TenantAdmission | None = None,
) -> None:
    """Parse, check and prepare ``request``, then start its exchange. A ``tenant``'s salt
    joins the request's cache salt (so its namespace) and its prompt tokens plus
    ``max_tokens`` are taken from its token budget. A long uncached prompt is tokenized in
    a worker thread (``_tokenize_off_loop``), so the event loop never waits on it."""
    # ``_value_``: the member's value without the ``value`` descriptor's two calls
    record = RequestRecord(key, request_id, endpoint._value_, 0, time.monotonic())
    try:
        priority = 0 if ctx.admission is None else _priority(request.headers.get(PRIORITY_HEADER))
        record.slo = _slo(request.headers, ctx.slo)
        parsed = check_model(parse_request(endpoint, request.body), ctx.model_names())
        if tenant is not None and parsed.prompted:
            parsed = _salted(parsed, tenant.salt)
        prepared = ctx.prompts.prepare(parsed, DEFER_CHARS)
    except TokenizeLater as later:
        ctx.metrics.tokenized_off_loop += 1
        ctx.spawn(_tokenize_off_loop(ctx, conn, request, record, parsed, priority, tenant,
                                     later))
        return
    except OpenAIError as exc:
        _refuse(ctx, conn, record, exc, endpoint.dialect)
        return
    _start(ctx, conn, request, record, parsed, prepared, priority, tenant)


async def _tokenize_off_loop(ctx: PipelineContext, conn: ServerConnection, request: HttpRequest,
                             record: RequestRecord, parsed: OpenAIRequest, priority: int,
                             tenant: TenantAdmission | None, later: TokenizeLater) -> None:
    """Tokenize ``later``'s text in a thread, then prepare again (its ids offered to the
    tokenizer, taken by that pass, with no await in between) and start the exchange. When
    another request is tokenizing the same text already, wait for it and prepare again
    instead (``routing.prompt.flights``)."""
    tok = ctx.prompts.tokenizer
    assert tok is not None  # only a tokenizer defers
    for attempt in range(_DEFER_ATTEMPTS):
        defer = None if attempt == _DEFER_ATTEMPTS - 1 else DEFER_CHARS
        flight = ctx.tokenizing.pending(later.share_key)
        if flight is not None:
            ctx.metrics.tokenize_shared += 1
            await asyncio.shield(flight)
            prepared = _prepare_again(ctx, conn, record, parsed, defer)
        else:
            with ctx.tokenizing.lead(later.share_key):
                try:
                    ids = await asyncio.to_thread(tok.encode_off_loop, later.text,
                                                  later.add_special_tokens)
                except Exception as exc:  # the library's error: this request's, nobody else's
                    log.exception("tokenize_off_loop_failed",
                                  request_id=record.request_id.decode())
                    _refuse(ctx, conn, record, OpenAIError(500, f"tokenizing failed: {exc}",
                                                           code="internal_error"))
                    return
                tok.offer(later.text, later.add_special_tokens, ids)
                try:  # in the flight: its followers wake to the pieces this pass caches
                    prepared = _prepare_again(ctx, conn, record, parsed, defer)
                finally:
                    tok.withdraw()
        if prepared is None:
            return
        if isinstance(prepared, TokenizeLater):  # another long text (the cache changed)
            later = prepared
            continue
        _start(ctx, conn, request, record, parsed, prepared, priority, tenant)
        return


def _prepare_again(ctx: PipelineContext, conn: ServerConnection, record: RequestRecord,
                   parsed: OpenAIRequest, defer_chars: int | None
                   ) -> PreparedPrompt | TokenizeLater | None:
    """Prepare a request that waited for its tokens; None: it was answered instead (its
    client went away meanwhile, or the prompt was refused)."""
    if conn.closed:
        record.finish(499, ctx.metrics, ctx.router.block_size, ctx.log_requests)
        return None
    try:
        return ctx.prompts.prepare(parsed, defer_chars)
    except TokenizeLater as again:
        return again
    except OpenAIError as exc:
        _refuse(ctx, conn, record, exc)
        return None


def _refuse(ctx: PipelineContext, conn: ServerConnection, record: RequestRecord,
            exc: OpenAIError, dialect: Dialect = Dialect.OPENAI) -> None:
    record.finish(exc.status, ctx.metrics, ctx.router.block_size, ctx.log_requests)
    reply_headers = b"x-request-id: %s\r\n" % record.request_id
    if isinstance(exc, _OverTokenLimit):
        reply_headers += b"retry-after: %d\r\n%s: %s\r\n" % (
            max(1, math.ceil(exc.wait_s)), SHED_HEADER, SHED_RATE_LIMIT)
    conn.respond(exc.status, exc.body(dialect), extra_headers=reply_headers)


def _start(ctx: PipelineContext, conn: ServerConnection, request: HttpRequest,
           record: RequestRecord, parsed: OpenAIRequest, prepared: PreparedPrompt,
           priority: int, tenant: TenantAdmission | None) -> None:
    """Take the tenant's tokens, count, and start the exchange."""
    if tenant is not None:
        wait_s = tenant.take_tokens(prepared.prompt_tokens + (parsed.max_tokens or 0))
        if wait_s:
            ctx.metrics.rate_limited += 1
            _refuse(ctx, conn, record, _OverTokenLimit(tenant.name, wait_s),
                    parsed.endpoint.dialect)
            return
    if prepared.media:
        ctx.metrics.media_requests += 1
    if prepared.timed:
        ctx.metrics.tokenized_tokens += prepared.tokenized
        ctx.metrics.tokenizer_cache_hit_tokens += prepared.cache_hit_tokens
    record.prompt_tokens = prepared.prompt_tokens
    headers = request.headers
    extra = b""
    for name in ctx.forwarded_headers:  # a loop, not a comprehension: no call (Python 3.11)
        if value := headers.get(name):
            extra += b"%s: %s\r\n" % (name, value)
    token_path = prepared.token_ids is not None and takes_token_path(parsed)
    body = request.body if prepared.body is None else prepared.body
    if tenant is not None and prepared.body is None and parsed.prompted:
        body = orjson.dumps(parsed.body)  # the tenant's salt in the forwarded body too
    target = LegTarget(
        parsed,
        request.path,
        body,
        prepared.token_ids,
        record.request_id,
        extra,
        token_path,
    )
    pairing = None if ctx.pd is None else PdPairing(ctx.pd)
    exchange = Exchange(ctx, conn, record, parsed, prepared, target, pairing)
    exchange.priority = priority
    if tenant is not None:
        exchange.tenant, exchange.weight = tenant.name, tenant.weight
    if ctx.sessions is not None:
        exchange.session = headers.get(SESSION_HEADER)
    exchange.start()


def _slo(headers: dict[bytes, bytes], default: Slo) -> Slo:
    try:
        return parse_slo(headers, default)
    except ValueError as exc:
        header = SLO_TTFT_HEADER if SLO_TTFT_HEADER.decode() in str(exc) else SLO_ITL_HEADER
        raise OpenAIError(400, str(exc), param=header.decode()) from None


def _priority(raw: bytes | None) -> int:
    try:
        return parse_priority(raw)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=PRIORITY_HEADER.decode()) from None


def tenant_cache_salt(tenant_salt: str, client_salt: str | None) -> str:
    """The salt of a tenant's namespace: the tenant's salt, then the client's own (a hex salt
    holds no ``:``, so no client salt can name another tenant's namespace)."""
    return tenant_salt if client_salt is None else f"{tenant_salt}:{client_salt}"


def _salted(parsed: OpenAIRequest, tenant_salt: str) -> OpenAIRequest:
    """The request in its tenant's namespace (``tenant_cache_salt``)."""
    salt = tenant_cache_salt(tenant_salt, parsed.cache_salt)
    return replace(parsed, cache_salt=salt, body={**parsed.body, "cache_salt": salt})


def check_model(parsed: OpenAIRequest, names: Sequence[str]) -> OpenAIRequest:
    """The request, its model served here; ``<base>:<adapter>`` names a LoRA adapter of a
    served base model (SGLang's form): its blocks live in that adapter's namespace."""
    if not names or parsed.model in names:
        return parsed
    base, sep, adapter = parsed.model.partition(":")
    if sep and adapter and base in names:
        return replace(parsed, model=base, lora_name=adapter)
    raise OpenAIError(
        404,
        f"the model {parsed.model!r} does not exist; this gateway serves {list(names)} "
        "(and their LoRA adapters as '<model>:<adapter>')",
        param="model",
        code=MODEL_NOT_FOUND,
    )
