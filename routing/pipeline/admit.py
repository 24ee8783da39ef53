"""The parse and prepare stages: a proxied HTTP request becomes an ``Exchange``, or an answer.

Parse (``routing.prompt.openai_api``), check the model, prepare (template, tokens, hashes:
``PromptPreparer``); a request that fails any of them is answered at once with an
OpenAI-shaped error and still finishes through its record (metrics, log line).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from kvcore.errors import OpenAIError
from routing.http.server import HttpRequest, ServerConnection
from routing.pipeline.context import PipelineContext
from routing.pipeline.exchange import Exchange
from routing.pipeline.legs import LegTarget
from routing.pipeline.pair import PairExchange
from routing.pipeline.record import RequestRecord
from routing.pipeline.sidecar_body import takes_token_path
from routing.prompt.openai_api import Endpoint, OpenAIRequest, parse_request

__all__ = ["admit"]


def admit(
    ctx: PipelineContext,
    conn: ServerConnection,
    request: HttpRequest,
    endpoint: Endpoint,
    key: str,
    request_id: bytes,
) -> None:
    """Parse, check and prepare ``request``, then start its exchange."""
    record = RequestRecord(key, request_id, endpoint.value, 0, time.monotonic())
    try:
        parsed = _check_model(parse_request(endpoint, request.body), ctx.model_names())
        prepared = ctx.prompts.prepare(parsed)
    except OpenAIError as exc:
        record.finish(exc.status, ctx.metrics, ctx.router.block_size, ctx.log_requests)
        conn.respond(exc.status, exc.body(), extra_headers=b"x-request-id: %s\r\n" % request_id)
        return
    if prepared.media:
        ctx.metrics.media_requests += 1
    if prepared.timed:
        ctx.metrics.tokenized_tokens += prepared.tokenized
        ctx.metrics.tokenizer_cache_hit_tokens += prepared.cache_hit_tokens
    record.prompt_tokens = prepared.prompt_tokens
    headers = request.headers
    extra = b"".join(
        [b"%s: %s\r\n" % (h, v) for h in ctx.forwarded_headers if (v := headers.get(h))]
    )
    token_path = prepared.token_ids is not None and takes_token_path(parsed)
    target = LegTarget(
        parsed,
        request.path,
        request.body if prepared.body is None else prepared.body,
        prepared.token_ids,
        request_id,
        extra,
        token_path,
    )
    kind = Exchange if ctx.pd is None else PairExchange
    kind(ctx, conn, record, parsed, prepared, target).start()


def _check_model(parsed: OpenAIRequest, names: Sequence[str]) -> OpenAIRequest:
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
        "NotFoundError",
        param="model",
        code="model_not_found",
    )
