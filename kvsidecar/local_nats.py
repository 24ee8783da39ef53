"""A local ``nats-server`` on an ephemeral port, JetStream on (``kvsidecar.local_server``):
what gateway replicas share in their tests and ``scripts/bench_replicas.py`` (Debian's
``nats-server`` package). Ready once it greets a client with INFO."""

from __future__ import annotations

import socket

from kvsidecar.local_server import LocalServer

__all__ = ["NatsServer"]


class NatsServer(LocalServer):
    """``with NatsServer(tmp_path) as nats:`` ... ``nats.url``; ``kill()``/``start()``; its
    log and its JetStream store go in the work directory."""

    binary_name = package = "nats-server"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def argv(self, port: int) -> list[str]:
        store = self.workdir / f"nats-{port}"
        store.mkdir(parents=True, exist_ok=True)
        return [self.binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]

    def answers(self, port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                return s.recv(4096).startswith(b"INFO ")
        except OSError:
            return False
