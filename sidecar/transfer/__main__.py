"""``python -m sidecar.transfer``: a block store owner with its transfer service, alone.

A sidecar without an engine: it owns a store (engine hooks may attach to its socket) and
exports its blocks to peers and pulls blocks from them. For tests, benchmarks and
operators who want a standalone host-tier peer. Prints one JSON ready line on stdout,
``{"event": "block_peer_ready", "url": ..., "socket": ..., "segment": ..., "pid": ...}``,
and writes the same line to ``--ready-file`` when given; runs until SIGTERM or SIGINT, when
it unlinks its segment and socket. Its options are ``BlockPeerConfig``'s (with ``--config
FILE``).

Besides the routes peers pull through it serves ``POST /v1/blocks/pull``, which pulls from
another peer into this store (``service``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import orjson
import uvloop
from aiohttp import web

from kvcore.control_token import CONTROL_TOKEN_HEADER
from kvcore.logs import configure_logging
from shm.errors import OwnerConflictError
from shm.owner.server import BlockStoreOwner
from sidecar.control_guard import token_guard
from sidecar.transfer.peer_config import BlockPeerConfig
from sidecar.transfer.service import BlockTransferService

# Run as ``python -m sidecar.transfer`` this module is ``__main__``; ``kvsidecar blocks``
# imports it.
_PROG = "python -m sidecar.transfer" if __name__ == "__main__" else "kvsidecar blocks"


async def _serve(cfg: BlockPeerConfig) -> None:
    owner_cfg, token = cfg.owner, cfg.control_token
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with (
        BlockStoreOwner(owner_cfg) as owner,
        aiohttp.ClientSession(
            headers=None if token is None else {CONTROL_TOKEN_HEADER: token}
        ) as session,
        BlockTransferService(owner, session, cfg.transfer) as service,
    ):
        app = web.Application(middlewares=[] if token is None else [token_guard(token)])
        app.add_routes(service.routes())
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        try:
            bound = next(a for a in runner.addresses if isinstance(a, tuple))
            assert owner.segment is not None
            line = orjson.dumps({
                "event": "block_peer_ready", "url": f"http://{cfg.host}:{bound[1]}",
                "socket": str(owner_cfg.socket_path), "segment": owner.segment.name,
                "owner_id": owner_cfg.owner_id, "pid": os.getpid(),
            }).decode()
            if cfg.ready_file is not None:
                cfg.ready_file.write_text(line + "\n")
            print(line, flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = BlockPeerConfig.from_args(argv, prog=_PROG)
    configure_logging(cfg.log_level.value)
    try:
        uvloop.run(_serve(cfg))
    except OwnerConflictError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
