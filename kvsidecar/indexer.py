"""``kvsidecar indexer``: the gateway's prefix index without the proxy, behind the KV indexer API.

Other routers (Dynamo's, vllm-router, a Mooncake conductor client) register engines' KV event
publishers and ask what each instance holds, in the API of Mooncake's RFC #1403
(``docs/indexer-api.md``):

* ``POST /register``: follow a vLLM or SGLang ZMQ publisher (``endpoint``, optional
  ``replay_endpoint``) as DP rank ``dp_rank`` of ``instance_id`` under ``tenant_id``
  (``indexer_registry``); ``POST /unregister`` stops it and forgets its blocks;
* ``POST /query`` (token ids, hashed as the gateway hashes them) and ``POST /query_by_hash``
  (the RFC's XXH3-64 rolling hashes with seed ``--xxh3-seed``, kept for every stored block
  from its events' token ids; or ours, ``hash_scheme: "kvsidecar-v1"``): per instance
  registered under the tenant for that model and block size, ``longest_matched`` and the
  tokens on each medium and DP rank;
* ``GET /workers`` (every registration and what the index holds of it), ``/health``,
  ``/metrics``.

Errors are the gateway's: the OpenAI error shape (``kvcore.errors``), naming the field.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import structlog
import uvloop
from aiohttp import web
from prometheus_client import generate_latest

from kvcore.errors import METHOD_NOT_ALLOWED, MODEL_NOT_FOUND, UNKNOWN_ENDPOINT, OpenAIError
from kvcore.logs import configure_logging
from kvcore.options import OptionParser, check_bounds, option
from kvsidecar.indexer_registry import Registrations
from routing.indexer.answer import answer
from routing.indexer.requests import (
    DEFAULT_TENANT,
    IndexQuery,
    parse_query,
    parse_query_by_hash,
    parse_register,
    parse_unregister,
)
from routing.indexer.rolling_hashes import DEFAULT_XXH3_SEED

__all__ = ["IndexerConfig", "build_app", "main", "query"]

log = structlog.get_logger(component="indexer")
_SERVER = "server"
_EVENTS = "KV events"
REGISTRATIONS = web.AppKey("registrations", Registrations)


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """``kvsidecar indexer``'s options."""

    host: str = option("0.0.0.0", group=_SERVER, help="address the HTTP API listens on")
    port: int = option(8090, group=_SERVER, ge=0, le=65535,
                       help="port of the HTTP API (0: any free port, printed in indexer_started)")
    log_level: str = option("info", group=_SERVER, choices=("debug", "info", "warning",
                                                              "error"), help="log level")
    ready_file: Path | None = option(None, group=_SERVER, metavar="FILE",
                                     help="write one JSON ready line here once serving")
    replay_timeout_s: float = option(2.0, group=_EVENTS, gt=0,
                                     help="how long a publisher's replay socket may take to "
                                     "answer before the gap is left to a resync")
    idle_probe_s: float = option(1.0, group=_EVENTS, gt=0,
                                 help="while a publisher is quiet, ask its replay socket this "
                                 "often for batches the live socket dropped")
    xxh3_seed: int = option(DEFAULT_XXH3_SEED, group=_EVENTS, ge=0, le=(1 << 64) - 1,
                            metavar="SEED",
                            help="the seed S of the RFC's XXH3-64 rolling hashes, which "
                            "/query_by_hash takes (Dynamo's is 1337)")

    def __post_init__(self) -> None:
        check_bounds(self)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None) -> IndexerConfig:
        parser = OptionParser(
            prog="kvsidecar indexer",
            description="The KV indexer API of Mooncake's RFC #1403 (/register, /unregister, "
            "/query, /query_by_hash) over the gateway's prefix index, fed by the vLLM and "
            "SGLang ZMQ KV event publishers registered with it.",
        )
        parser.add_options(cls)
        return parser.build(cls, parser.parse_args(argv))


def query(registrations: Registrations, q: IndexQuery) -> bytes:
    """The answer to ``/query`` or ``/query_by_hash``: ``{tenant: {instance: ...}}``."""
    models = registrations.models()
    sizes = models.get(q.model)
    if sizes is None:
        raise OpenAIError(404, f"no publisher of model {q.model!r} is registered; registered "
                          f"models: {sorted(models)}", param="model", code=MODEL_NOT_FOUND)
    if q.block_size not in sizes:
        raise OpenAIError(400, f"'block_size' is {q.block_size}, but model {q.model!r} is "
                          f"registered with blocks of {sorted(sizes)} tokens",
                          param="block_size")
    tenant = q.tenant_id or DEFAULT_TENANT
    return answer(q, registrations.index, registrations.hasher(q.block_size), tenant,
                  q.cache_salt, registrations.instances(tenant, q.model, q.block_size),
                  registrations.rolling)


def _json(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _refusing(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except OpenAIError as exc:
            return _json(exc.status, exc.body())
    return wrapped


async def _register(request: web.Request) -> web.Response:
    reg = parse_register(await request.read())
    request.app[REGISTRATIONS].register(reg)
    return _json(200, orjson.dumps({"status": "registered successfully",
                                    "instance_id": reg.instance_id}))


async def _unregister(request: web.Request) -> web.Response:
    removed = await request.app[REGISTRATIONS].unregister(parse_unregister(await request.read()))
    return _json(200, orjson.dumps({"status": "unregistered successfully",
                                    "removed_instances": removed}))


async def _query(request: web.Request) -> web.Response:
    return _json(200, query(request.app[REGISTRATIONS], parse_query(await request.read())))


async def _query_by_hash(request: web.Request) -> web.Response:
    q = parse_query_by_hash(await request.read())
    return _json(200, query(request.app[REGISTRATIONS], q))


async def _workers(request: web.Request) -> web.Response:
    return _json(200, orjson.dumps(request.app[REGISTRATIONS].state()))


async def _health(request: web.Request) -> web.Response:
    return _json(200, b'{"status":"ok"}')


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRATIONS].metrics.registry)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                  ) -> web.StreamResponse:
    """aiohttp's own 404 and 405 in our error shape."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        error = OpenAIError(405, f"{request.path} takes {', '.join(sorted(exc.allowed_methods))}"
                            f", not {request.method}", code=METHOD_NOT_ALLOWED)
        return web.Response(status=405, body=error.body(), content_type="application/json",
                            headers={"allow": ", ".join(sorted(exc.allowed_methods))})
    except web.HTTPNotFound:
        error = OpenAIError(404, f"no route for {request.method} {request.path}: this indexer "
                            "serves POST /register, /unregister, /query, /query_by_hash and GET "
                            "/workers, /health, /metrics", code=UNKNOWN_ENDPOINT)
        return _json(404, error.body())


def build_app(registrations: Registrations) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[REGISTRATIONS] = registrations
    for path, handler in (("/register", _register), ("/unregister", _unregister),
                          ("/query", _query), ("/query_by_hash", _query_by_hash)):
        app.router.add_post(path, _refusing(handler))
    app.router.add_get("/workers", _workers)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def serve(cfg: IndexerConfig) -> int:
    registrations = Registrations(replay_timeout_s=cfg.replay_timeout_s,
                                  idle_probe_s=cfg.idle_probe_s, xxh3_seed=cfg.xxh3_seed)
    runner = web.AppRunner(build_app(registrations), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '') else cfg.host}:{port}"
    log.info("indexer_started", url=url, port=port)
    if cfg.ready_file is not None:
        ready = {"event": "indexer_started", "url": url, "port": port}
        cfg.ready_file.write_bytes(orjson.dumps(ready) + b"\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("indexer_stopping")
    await runner.cleanup()
    await registrations.aclose()
    log.info("indexer_stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = IndexerConfig.from_args(argv)
    configure_logging(cfg.log_level)
    try:
        return uvloop.run(serve(cfg))
    except OSError as exc:
        print(f"kvsidecar indexer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
