"""The HTTP shell: SGLang's native routes over one :class:`Engine` (OpenAI routes live in
:mod:`refengine.openai_api`, Anthropic's ``/v1/messages`` in :mod:`refengine.anthropic_api`).

``/generate`` (text or ``input_ids``, streaming SSE with cumulative ``text``/``output_ids`` as
SGLang does by default), ``/health`` and ``/health_generate`` (the step loop advances: a
one-token generation when idle),
``/server_info`` (resolved args, ``max_total_num_tokens``, ``kv_events`` block),
``/flush_cache``, ``/v1/loads`` and ``/get_load``, ``/abort_request``, ``/model_info``,
``/metrics``. Errors are SGLang's ``{"error": {"message": ...}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from typing import Any

from aiohttp import web

from refengine import anthropic_api, openai_api
from refengine.config import DisaggMode, EngineConfig
from refengine.engine import HEALTH_CHECK_PREFIX, Engine
from refengine.http_common import (
    ENGINE,
    dumps,
    error_response,
    json_response,
    output_text,
    read_json,
    run_stream,
)
from refengine.page_hash import extend_storage_keys
from refengine.protocol import BadRequest, GenerateInput, meta_info, parse_generate
from refengine.request import Request, SamplingParams

__all__ = ["build_app"]

VERSION = "0.5.23-refengine"
HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
_HEALTH_TIMEOUT_S = web.AppKey("health_timeout_s", float)


def _kv_transfer(engine: Engine, req: Request) -> dict[str, Any]:
    """What the prefill role exported: the leading prompt pages the store confirmed holding."""
    n = req.exported_pages
    keys = extend_storage_keys(req, n, engine.page_size)
    return {"page_size": engine.page_size, "num_pages": n, "page_keys": keys}


def _check_import(engine: Engine, req: Request, spec: Any) -> None:
    if spec is None:
        return
    if not isinstance(spec, dict) or not isinstance(spec.get("page_keys"), list):
        raise BadRequest('kv_transfer must be an object {"page_keys": [...]}')
    keys = spec["page_keys"]
    mine = extend_storage_keys(req, len(req.prompt) // engine.page_size, engine.page_size)
    if keys != mine[: len(keys)]:
        raise BadRequest(
            "kv_transfer.page_keys do not match this prompt's pages (other model, "
            "page size, salt or tokens?)"
        )


def _render(engine: Engine, req: Request, started: float, with_text: bool) -> dict[str, Any]:
    meta = meta_info(req, started)
    if req.export_pages and req.finish is not None:
        meta["kv_transfer"] = _kv_transfer(engine, req)
    out: dict[str, Any] = {"text": output_text(engine.tokenizer, req)} if with_text else {}
    out["output_ids"] = list(req.output_ids)
    out["meta_info"] = meta
    return out


def _abort_status(req: Request) -> tuple[str, int] | None:
    f = req.finish
    if f is not None and f.kind == "abort" and f.status_code:
        return f.message or "aborted", f.status_code
    return None


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await read_json(request)
        parsed: GenerateInput = parse_generate(body, engine.tokenizer)
        if engine.cfg.disaggregation_mode is DisaggMode.DECODE:
            for req in parsed.requests:
                _check_import(engine, req, body.get("kv_transfer"))
        if parsed.stream:
            return await _generate_stream(request, engine, parsed.requests[0])
        started = time.monotonic()
        outs = await asyncio.gather(*(_collect(engine, r) for r in parsed.requests))
    except BadRequest as exc:
        return error_response(str(exc), exc.status)
    for req in outs:
        if (err := _abort_status(req)) is not None:
            return error_response(*err)
    # SGLang renders text even for input_ids requests (the tokenizer is loaded).
    rendered = [_render(engine, r, started, True) for r in outs]
    return json_response(rendered if parsed.batch else rendered[0])


async def _collect(engine: Engine, req: Request) -> Request:
    async for _ in run_stream(engine, req):
        pass
    return req


async def _generate_stream(
    request: web.Request, engine: Engine, req: Request
) -> web.StreamResponse:
    started = time.monotonic()
    stream = run_stream(engine, req)
    first = await anext(stream)  # raises BadRequest before any byte is sent
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    async with contextlib.aclosing(stream):
        current: Request | None = first
        while current is not None:
            if (err := _abort_status(current)) is not None:
                payload = {
                    "error": {
                        "message": err[0],
                        "type": "invalid_request_error",
                        "code": err[1],
                        "retryable": False,
                    }
                }
            else:
                payload = _render(engine, current, started, True)
            await resp.write(b"data: " + dumps(payload) + b"\n\n")
            current = await anext(stream, None)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    """SGLang's /health: the engine is healthy when its step loop advances. While it has
    work that is the loop's next pass (``refengine.heartbeat``: the probe does not queue
    behind the work); idle, a one-token generation must come back. Either within the app's
    health timeout (``HEALTH_TIMEOUT_S``)."""
    engine = request.app[ENGINE]
    if not engine.accepting or not engine.loop_alive:
        return web.Response(status=503)
    try:
        async with asyncio.timeout(request.app[_HEALTH_TIMEOUT_S]):
            if engine.has_work:
                await engine.heartbeat.next()
                return web.Response(status=200)
            req = Request(
                f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}",
                [0],
                SamplingParams(max_new_tokens=1, temperature=0),
            )
            await _collect(engine, req)
    except (TimeoutError, BadRequest):
        return web.Response(status=503)
    return web.Response(status=200 if req.finish and req.finish.kind != "abort" else 503)


def server_args(cfg: EngineConfig, port: int) -> dict[str, Any]:
    return {
        "model_path": str(cfg.model_path),
        "tokenizer_path": str(cfg.model_path),
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": port,
        "page_size": cfg.page_size,
        "max_total_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_running_requests": cfg.max_running_requests,
        "kv_events_config": cfg.kv_events_config,
        "enable_hierarchical_cache": cfg.page_store is not None,
        "hicache_storage_backend": cfg.page_store,
        "hicache_write_policy": cfg.hicache_write_policy,
        "disaggregation_mode": cfg.disaggregation_mode.value,
        "dp_size": 1,
        "tp_size": 1,
        "compute": cfg.compute.value,
        "speedup": cfg.timing.speedup,
    }


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cfg = engine.cfg
    port = request.url.port or cfg.port
    info = server_args(cfg, port)
    info.update(
        {
            "max_total_num_tokens": cfg.num_pages * cfg.page_size,
            "max_req_input_len": engine.model_cfg.max_position_embeddings - 1,
            "kv_events": engine.publisher.describe(cfg.page_size) if engine.publisher else None,
            "internal_states": [engine.load()],
            "version": VERSION,
            "frontend": "python",
            "engine": "refengine",
            "kv_bytes_per_token": engine.model_cfg.kv_bytes_per_token,
            "replica": engine.replica,
        }
    )
    return json_response(info)


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response(
        {
            "model_path": str(engine.cfg.model_path),
            "tokenizer_path": str(engine.cfg.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    ok = await request.app[ENGINE].flush_cache()
    if ok:
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will "
            "not be performed.)\n"
        )
    return web.Response(
        status=400, text="Flush cache failed: there are running or waiting requests.\n"
    )


async def loads(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    rank = request.query.get("dp_rank")
    if rank not in (None, "0"):
        return error_response(f"dp_rank {rank} does not exist (dp_size is 1)")
    return json_response(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": VERSION,
            "accelerator": "cpu",
            "num_accelerators": 0,
            "loads": [engine.load()],
        }
    )


async def get_load(request: web.Request) -> web.Response:
    return json_response([request.app[ENGINE].load()])


async def abort_request(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return error_response(str(exc))
    if not isinstance(body, dict):
        return error_response("the request body must be a JSON object")
    if body.get("abort_all"):
        for running in engine.running_ids():
            engine.abort(running)
        return web.Response(status=200)
    rid = body.get("rid")
    if not isinstance(rid, str):
        return error_response("rid must be a string")
    engine.abort(rid)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    load = engine.load()
    s = engine.stats
    lines = [
        f"sglang:num_running_reqs {load['num_running_reqs']}",
        f"sglang:num_queue_reqs {load['num_waiting_reqs']}",
        f"sglang:num_used_tokens {load['num_used_tokens']}",
        f"sglang:token_usage {load['token_usage']}",
        f"sglang:cache_hit_rate {load['cache_hit_rate']}",
        f"sglang:prompt_tokens_total {s.prompt_tokens}",
        f"sglang:generation_tokens_total {s.generated_tokens}",
        f"sglang:cached_tokens_total {s.cached_tokens_device + s.cached_tokens_storage}",
        f"refengine_cached_tokens_storage_total {s.cached_tokens_storage}",
        f"refengine_step_failures_total {s.step_failures}",
        f"refengine_num_cached_pages {engine.cache.num_cached}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


_OPEN_PATHS = ("/health", "/ready", "/metrics")  # SGLang leaves probes open under --api-key


def _api_key_middleware(api_key: str) -> Any:
    """SGLang's ``--api-key``: a bearer token on every route but the probes, else 401."""
    expected = f"Bearer {api_key}"

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" and not request.path.startswith(_OPEN_PATHS):
            given = request.headers.get("Authorization", "")
            if not secrets.compare_digest(given.encode(), expected.encode()):
                return json_response({"error": "Unauthorized"}, 401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def build_app(engine: Engine, health_timeout_s: float = HEALTH_TIMEOUT_S) -> web.Application:
    api_key = engine.cfg.api_key
    middlewares = [_api_key_middleware(api_key)] if api_key else []
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app[ENGINE] = engine
    app[_HEALTH_TIMEOUT_S] = health_timeout_s
    r = app.router
    r.add_route("POST", "/generate", generate)
    r.add_route("PUT", "/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_route("GET", "/flush_cache", flush_cache)
    r.add_route("POST", "/flush_cache", flush_cache)
    r.add_get("/v1/loads", loads)
    r.add_get("/get_load", get_load)
    r.add_post("/abort_request", abort_request)
    r.add_get("/metrics", metrics)
    openai_api.add_routes(app)
    anthropic_api.add_routes(app)
    return app
