"""The client-facing HTTP server: a handler that raises answers its own request only."""

from __future__ import annotations

import asyncio

import orjson
from structlog.testing import capture_logs

from routing.http.server import HttpRequest, ServerConnection


class _Handler:
    """Raises on /boom before answering, on /half after writing a response head."""

    def handle(self, conn: ServerConnection, request: HttpRequest) -> None:
        if request.path == b"/boom":
            raise RuntimeError("a bug in the handler")
        if request.path == b"/half":
            conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhal")
            raise RuntimeError("a bug after the head")
        conn.respond(200, b"{}")


async def _exchange(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = await reader.read()  # the server closes the connection in every case here
    writer.close()
    await writer.wait_closed()
    return data


async def test_a_raising_handler_answers_500_and_is_logged() -> None:
    """An exception in the handler is a logged 500 in OpenAI's shape, not a vanished request."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ServerConnection(_Handler(), 1 << 20),
                                      "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with capture_logs() as logs:
            reply = await _exchange(port, b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500 ")
        assert orjson.loads(body)["error"]["type"] == "server_error"
        assert [e["path"] for e in logs if e["event"] == "request_handler_failed"] == ["/boom"]
        # a response already begun is cut, never completed with a 500 appended
        cut = await _exchange(port, b"GET /half HTTP/1.1\r\nhost: x\r\n\r\n")
        assert cut == b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhal"
    finally:
        server.close()
        await server.wait_closed()
