"""Fallback transport: a plain TCP stream of block bytes, one connection per export.

Exporter: ``TcpBlockServer`` listens on its own port (advertised in each TCP offer). A
connection opens with ``HELLO`` (``b"KVX1"`` + the 16-byte export id); the server answers
one status byte (0: the blocks follow; otherwise an error code, a u16 length and a UTF-8
message) and writes each leased slot straight from the mapping (``sock_sendall`` on a view:
no intermediate copy). The export's leases are released when the stream ends, however it
ends, so a dead importer (a reset connection) frees them at once.

Importer: ``receive_blocks`` connects, sends the hello and reads the stream straight into
its reserved slot views with ``sock_recv_into``: no ``bytes`` object per block. A stream
that ends early means the exporter died: ``PeerUnavailableError``.

Both ends set ``TCP_NODELAY`` and large socket buffers, and run on the event loop's
non-blocking socket calls, so a cancelled pull stops reading at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import uuid
from collections.abc import Callable

import numpy as np
import structlog

from sidecar.transfer.errors import ExportGoneError, PeerUnavailableError, TransferError
from sidecar.transfer.exports import Export, ExportTable
from sidecar.transfer.messages import Transport

__all__ = ["TcpBlockServer", "receive_blocks"]

log = structlog.get_logger(component="transfer")

MAGIC = b"KVX1"
_HELLO_BYTES = len(MAGIC) + 16
_OK = 0
_GONE = 1
_BAD_HELLO = 2
_ERROR_HEAD = struct.Struct("<BH")
_HELLO_TIMEOUT_S = 10.0


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        count = await loop.sock_recv_into(sock, view[got:])
        if count == 0:
            raise ConnectionResetError(f"stream closed after {got} of {n} bytes")
        got += count
    return bytes(buf)


class TcpBlockServer:
    """Serves open TCP exports from ``table``; rows are the owner's slot views."""

    def __init__(self, table: ExportTable, rows: Callable[[], np.ndarray], *,
                 buffer_bytes: int) -> None:
        self._table = table
        self._rows = rows
        self._buffer_bytes = buffer_bytes
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._streams: set[asyncio.Task[None]] = set()
        self.port: int | None = None
        self.num_bytes_sent = 0

    async def start(self, host: str, port: int) -> None:
        listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(), name="transfer_tcp_accept")
        log.info("transfer_tcp_listening", host=host, port=self.port)

    async def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(conn), name="transfer_tcp_stream")
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        export: Export | None = None
        with conn:
            _tune(conn, self._buffer_bytes)
            try:
                async with asyncio.timeout(_HELLO_TIMEOUT_S):
                    hello = await _recv_exactly(loop, conn, _HELLO_BYTES)
                if hello[:4] != MAGIC:
                    await self._refuse(conn, _BAD_HELLO, "not a kvsidecar block stream")
                    return
                export_id = uuid.UUID(bytes=hello[4:]).hex
                export = self._table.take(export_id)
                if export is None or export.transport is not Transport.TCP:
                    await self._refuse(conn, _GONE, f"export {export_id} is unknown or lapsed")
                    return
                await loop.sock_sendall(conn, bytes([_OK]))
                rows = self._rows()
                for slot in export.slots:
                    await loop.sock_sendall(conn, memoryview(rows[slot]))
                    self.num_bytes_sent += rows.shape[1]
            except (OSError, TimeoutError) as exc:
                log.warning("transfer_tcp_stream_broken", error=repr(exc),
                            export_id=None if export is None else export.export_id)
            finally:
                if export is not None:
                    self._table.close(export)

    @staticmethod
    async def _refuse(conn: socket.socket, code: int, message: str) -> None:
        raw = message.encode()[:1000]
        await asyncio.get_running_loop().sock_sendall(conn, _ERROR_HEAD.pack(code, len(raw)) + raw)

    async def aclose(self) -> None:
        tasks = [t for t in (self._accepting, *self._streams) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def receive_blocks(
    host: str, port: int, export_id: str, views: list[np.ndarray], *,
    buffer_bytes: int, progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``views`` in order from export ``export_id``'s stream."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        _tune(sock, buffer_bytes)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError as exc:
            raise PeerUnavailableError(f"cannot open the block stream to {host}:{port}: "
                                       f"{exc}") from exc
        total = sum(v.nbytes for v in views)
        got = 0
        try:
            await loop.sock_sendall(sock, MAGIC + uuid.UUID(hex=export_id).bytes)
            status = (await _recv_exactly(loop, sock, 1))[0]
            if status != _OK:
                _, length = _ERROR_HEAD.unpack(bytes([status]) + await _recv_exactly(loop, sock, 2))
                message = (await _recv_exactly(loop, sock, length)).decode(errors="replace")
                cls: type[TransferError] = ExportGoneError if status == _GONE else TransferError
                raise cls(f"the exporter refused the block stream: {message}")
            for view in views:
                mv = memoryview(view)  # type: ignore[arg-type]  # ndarray is a buffer
                size = view.nbytes
                filled = 0
                while filled < size:
                    count = await loop.sock_recv_into(sock, mv[filled:])
                    if count == 0:
                        raise ConnectionResetError("the exporter closed the stream")
                    filled += count
                    got += count
                    if progress is not None:
                        progress(count)
        except OSError as exc:
            raise PeerUnavailableError(
                f"the block stream from {host}:{port} broke after {got} of {total} bytes: "
                f"{exc}") from exc
