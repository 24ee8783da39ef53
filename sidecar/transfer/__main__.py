"""``python -m sidecar.transfer``: a block store owner with its transfer service, alone.

A sidecar without an engine: it owns a store (engine hooks may attach to its socket) and
exports its blocks to peers and pulls blocks from them. For tests, benchmarks and
operators who want a standalone host-tier peer. Prints one JSON ready line on stdout,
``{"event": "block_peer_ready", "url": ..., "socket": ..., "segment": ..., "pid": ...}``,
and writes the same line to ``--ready-file`` when given; runs until SIGTERM or SIGINT, when
it unlinks its segment and socket.

Besides the routes peers pull through it serves ``POST /v1/blocks/pull``, which pulls from
another peer into this store (``service``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import orjson
import uvloop
from aiohttp import web

from kvcore.control_token import CONTROL_TOKEN_ENV, CONTROL_TOKEN_HEADER, read_secret_file
from kvcore.logs import configure_logging
from shm.errors import OwnerConflictError
from shm.owner.config import OwnerConfig, parse_bytes
from shm.owner.server import BlockStoreOwner
from sidecar.control_guard import token_guard
from sidecar.transfer.config import TransferConfig
from sidecar.transfer.service import BlockTransferService

# Run as ``python -m sidecar.transfer`` this module is ``__main__``; ``kvsidecar blocks``
# imports it.
_PROG = "python -m sidecar.transfer" if __name__ == "__main__" else "kvsidecar blocks"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Run a KV block store owner with its sidecar-to-sidecar transfer service "
        "(export and import of blocks over shared memory, NIXL or TCP), without an engine.")
    p.add_argument("--owner-id", required=True, help="unique id on this host")
    p.add_argument("--socket", required=True, type=Path, help="the store's Unix socket path")
    p.add_argument("--capacity-bytes", required=True, type=parse_bytes,
                   help="byte budget for blocks, e.g. 256MiB")
    p.add_argument("--block-bytes", required=True, type=parse_bytes, help="bytes per block")
    p.add_argument("--dtype", default="uint8", help="element type of a block (default uint8)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    p.add_argument("--tcp-port", type=int, default=0,
                   help="port of the TCP block stream; 0 picks a free one")
    p.add_argument("--lease-ttl-s", type=float, default=30.0,
                   help="longest an export holds leases without a release (default 30)")
    p.add_argument("--no-nixl", action="store_true", help="do not offer the nixl transport")
    p.add_argument("--control-token-file", metavar="FILE",
                   help=f"a token callers must send as '{CONTROL_TOKEN_HEADER}' (and this peer "
                   f"sends to the peers it pulls from); or set {CONTROL_TOKEN_ENV}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--ready-file", type=Path, metavar="PATH",
                   help="also write the ready line to this file once serving")
    return p


async def _serve(
    owner_cfg: OwnerConfig, cfg: TransferConfig, host: str, port: int, token: str | None,
    ready_file: Path | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with (
        BlockStoreOwner(owner_cfg) as owner,
        aiohttp.ClientSession(
            headers=None if token is None else {CONTROL_TOKEN_HEADER: token}
        ) as session,
        BlockTransferService(owner, session, cfg) as service,
    ):
        app = web.Application(middlewares=[] if token is None else [token_guard(token)])
        app.add_routes(service.routes())
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        try:
            bound = next(a for a in runner.addresses if isinstance(a, tuple))
            assert owner.segment is not None
            line = orjson.dumps({
                "event": "block_peer_ready", "url": f"http://{host}:{bound[1]}",
                "socket": str(owner_cfg.socket_path), "segment": owner.segment.name,
                "owner_id": owner_cfg.owner_id, "pid": os.getpid(),
            }).decode()
            if ready_file is not None:
                ready_file.write_text(line + "\n")
            print(line, flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        owner_cfg = OwnerConfig(owner_id=args.owner_id, socket_path=args.socket,
                                capacity_bytes=args.capacity_bytes, block_bytes=args.block_bytes,
                                dtype=args.dtype, log_level=args.log_level)
        cfg = TransferConfig(tcp_host=args.host, tcp_port=args.tcp_port,
                             lease_ttl_s=args.lease_ttl_s, enable_nixl=not args.no_nixl)
        token = (os.environ.get(CONTROL_TOKEN_ENV) or None if args.control_token_file is None
                 else read_secret_file(args.control_token_file, "--control-token-file"))
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level)
    try:
        uvloop.run(_serve(owner_cfg, cfg, args.host, args.port, token, args.ready_file))
    except OwnerConflictError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
