"""``python -m shm`` (or ``kvsidecar shm``): run one block store owner until SIGTERM/SIGINT.

Prints one JSON line on stdout once clients can connect, e.g.
``{"event": "shm_owner_ready", "socket": "...", "segment": "/kvsidecar-...", "pid": 123}``,
and writes the same line to ``--ready-file`` when given. Structured logs go to stderr.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import orjson
import structlog
import uvloop

from kvcore.logs import configure_logging
from shm.errors import OwnerConflictError
from shm.owner.config import OwnerConfig
from shm.owner.server import BlockStoreOwner


async def _serve(config: OwnerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with BlockStoreOwner(config) as owner:
        assert owner.segment is not None
        line = orjson.dumps({
            "event": "shm_owner_ready",
            "socket": str(config.socket_path),
            "segment": owner.segment.name,
            "owner_id": config.owner_id,
            "pid": os.getpid(),
        }).decode()
        if config.ready_file is not None:
            tmp = config.ready_file.with_name(config.ready_file.name + ".tmp")
            tmp.write_text(line + "\n")
            tmp.replace(config.ready_file)
        print(line, flush=True)
        await stop.wait()


# Run as ``python -m shm`` this module is ``__main__``; ``kvsidecar shm`` imports it.
_PROG = "python -m shm" if __name__ == "__main__" else "kvsidecar shm"


def main(argv: list[str] | None = None) -> int:
    config = OwnerConfig.from_args(argv, prog=_PROG)
    configure_logging(config.log_level)
    structlog.get_logger(component="shm").info(
        "config_loaded", owner_id=config.owner_id, socket=str(config.socket_path),
        capacity_bytes=config.capacity_bytes, block_bytes=config.block_bytes,
        num_slots=config.num_slots, dtype=config.dtype, layout=config.layout)
    if config.sched_batch and hasattr(os, "SCHED_BATCH"):
        # Wake-ups of a SCHED_BATCH thread never preempt the running one. A client's one-way
        # Release then costs it a send, not a context switch to us and back; we run when it
        # blocks on its next reply (or at the next tick), and read both frames in one wake-up.
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            structlog.get_logger(component="shm").warning(
                "sched_batch_refused", error=str(exc))
    try:
        uvloop.run(_serve(config))
    except OwnerConflictError as exc:
        print(f"python -m shm: {exc}", file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"python -m shm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
