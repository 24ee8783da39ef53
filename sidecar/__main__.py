"""``python -m sidecar`` / ``kvsidecar sidecar``: run beside one engine replica.

Prints one JSON ready line on stdout once serving: ``{"event": "sidecar_ready", "url": ...,
"worker_ids": [...]}``. SIGTERM/SIGINT drain in-flight requests, close subscribers and exit 0.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys

import orjson
import uvloop

from kvcore.extras import MissingExtraError
from kvcore.logs import configure_logging
from sidecar.app import Sidecar
from sidecar.config import SidecarConfig
from sidecar.engine_watch import EngineUnavailableError

__all__ = ["main"]

# A stop still running this long after its drain's bound is stuck somewhere.
_STUCK_AFTER_DRAIN_S = 5.0


async def _run(cfg: SidecarConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with Sidecar(cfg) as sidecar:
            ready = {
                "event": "sidecar_ready",
                "url": sidecar.url,
                "worker_ids": list(sidecar.streams),
            }
            sys.stdout.write(orjson.dumps(ready).decode() + "\n")
            sys.stdout.flush()
            await stop.wait()
            # Then faulthandler writes every thread's stack to stderr, from a thread of its
            # own: seen even while the event loop is blocked, before a grace period runs out.
            faulthandler.dump_traceback_later(cfg.shutdown_timeout_s + _STUCK_AFTER_DRAIN_S)
    except (EngineUnavailableError, MissingExtraError) as exc:
        print(f"kvsidecar sidecar: {exc}", file=sys.stderr)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = SidecarConfig.from_args(argv)
    configure_logging(cfg.log_level)
    return uvloop.run(_run(cfg))


if __name__ == "__main__":
    sys.exit(main())
