"""``kvsidecar gateway`` / ``python -m routing``: run the gateway until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import orjson
import structlog
import uvloop

from kvcore.extras import MissingExtraError
from kvcore.logs import configure_logging
from routing.config import RouterConfig
from routing.flags import gateway_config
from routing.serve.gateway import Gateway
from routing.serve.startup import load_config_summary

__all__ = ["main"]

async def serve(cfg: RouterConfig) -> int:
    log = structlog.get_logger("routing", component="gateway")
    log.info("config_loaded", **load_config_summary(cfg))
    gateway = Gateway(cfg)
    port = await gateway.start()
    healthy = sum(w.probe_ok for w in gateway.workers)
    log.info(
        "gateway_started",
        host=cfg.host,
        port=port,
        url=f"{gateway.scheme}://{cfg.host}:{port}",
        workers=len(cfg.workers),
        sidecars=len(cfg.sidecars),
        healthy_workers=healthy,
        router_mode=cfg.router_mode.value,
    )
    if cfg.ready_file is not None:
        url = f"{gateway.scheme}://{cfg.host}:{port}"
        ready = {"event": "gateway_ready", "url": url, "port": port}
        cfg.ready_file.write_bytes(orjson.dumps(ready) + b"\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway_stopping", in_flight=gateway.in_flight)
    await gateway.stop(cfg.drain_timeout_s)
    log.info("gateway_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = gateway_config(argv)
    configure_logging(cfg.log_level.value)
    try:
        return uvloop.run(serve(cfg))
    except (ValueError, OSError, MissingExtraError) as exc:
        print(f"kvsidecar gateway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
