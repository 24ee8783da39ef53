"""A local ``redis-server`` on an ephemeral port (``kvsidecar.local_server``): the remote
tier's store for its tests and ``scripts/bench_tiers.py`` (Debian's ``redis-server``;
Valkey's binary works alike). No persistence; keyspace notifications left off (the remote
tier turns them on itself)."""

from __future__ import annotations

import socket
from pathlib import Path

from kvsidecar.local_server import LocalServer

__all__ = ["RedisServer", "redis_command"]


def redis_command(port: int, *args: str | bytes, timeout_s: float = 5.0) -> bytes:
    """One command in RESP, its raw reply (enough for PING, DBSIZE, GET, SET)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        parts += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(b"".join(parts))
        return s.recv(65536)


class RedisServer(LocalServer):
    """``with RedisServer(tmp_path) as redis:`` ... ``redis.url``; ``kill()``/``start()``."""

    binary_name = package = "redis-server"

    def __init__(self, workdir: Path, *, maxmemory: str | None = None) -> None:
        """``workdir``: its log goes there; ``maxmemory`` (e.g. ``"4gb"``): evict LRU keys
        past it, as a cache would be configured."""
        super().__init__(workdir)
        self.maxmemory = maxmemory

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self, port: int) -> list[str]:
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir)]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        return argv

    def answers(self, port: int) -> bool:
        try:
            return redis_command(port, "PING", timeout_s=1).startswith(b"+PONG")
        except OSError:
            return False
