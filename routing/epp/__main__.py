"""``kvsidecar epp`` / ``python -m routing.epp``: the endpoint picker, until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import orjson
import structlog

from kvcore.extras import MissingExtraError
from kvcore.logs import configure_logging
from routing.epp.config import EppConfig
from routing.epp.deps import load
from routing.epp.server import EppServer
from routing.serve.startup import load_config_summary

__all__ = ["main"]


async def serve(cfg: EppConfig) -> int:
    log = structlog.get_logger("routing.epp", component="epp")
    router = cfg.router
    log.info("config_loaded", **load_config_summary(router), grpc_port=cfg.grpc_port,
             body_mode=cfg.body_mode.value)
    server = EppServer(cfg, load())
    await server.start()
    url = f"http://{router.host}:{server.http_port}"
    grpc = f"{cfg.grpc_host}:{server.grpc_port}"
    log.info("epp_started", url=url, grpc=grpc, grpc_port=server.grpc_port,
             workers=len(router.workers), sidecars=len(router.sidecars),
             router_mode=router.router_mode.value)
    if router.ready_file is not None:
        ready = {"event": "epp_ready", "url": url, "port": server.http_port,
                 "grpc_port": server.grpc_port}
        router.ready_file.write_bytes(orjson.dumps(ready) + b"\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("epp_stopping", in_flight=len(server.picker.in_flight))
    await server.stop()
    log.info("epp_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = EppConfig.from_args(argv)
    configure_logging(cfg.router.log_level.value)
    try:
        load()
    except MissingExtraError as exc:
        print(f"kvsidecar epp: {exc}", file=sys.stderr)
        return 2
    try:
        # grpc.aio runs on asyncio's own loop (not uvloop).
        return asyncio.run(serve(cfg))
    except (ValueError, OSError) as exc:
        print(f"kvsidecar epp: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
