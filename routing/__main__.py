"""``kvsidecar gateway`` / ``python -m routing``: run the gateway until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import orjson
import structlog
import uvloop

from routing.app import Gateway, load_config_summary
from routing.config import RouterConfig

__all__ = ["main"]

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str) -> None:
    """structlog's performance recipe: JSON lines on stderr (console rendering on a TTY)."""
    tty = sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if tty else structlog.processors.JSONRenderer(orjson.dumps)
    )
    structlog.configure(
        cache_logger_on_first_use=True,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        logger_factory=structlog.WriteLoggerFactory(sys.stderr)
        if tty
        else structlog.BytesLoggerFactory(sys.stderr.buffer),
    )


async def serve(cfg: RouterConfig) -> int:
    log = structlog.get_logger("routing").bind(component="gateway")
    log.info("config_loaded", **load_config_summary(cfg))
    gateway = Gateway(cfg)
    port = await gateway.start()
    healthy = sum(w.healthy for w in gateway.workers)
    log.info(
        "gateway_started",
        host=cfg.host,
        port=port,
        url=f"http://{cfg.host}:{port}",
        workers=len(cfg.workers),
        healthy_workers=healthy,
        router_mode=cfg.router_mode.value,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway_stopping", in_flight=len(gateway.exchanges))
    await gateway.stop()
    log.info("gateway_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = RouterConfig.from_args(argv)
    configure_logging(cfg.log_level.value)
    try:
        return uvloop.run(serve(cfg))
    except (ValueError, OSError) as exc:
        print(f"kvsidecar gateway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
