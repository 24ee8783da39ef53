"""Faults injected at an engine's KV-event publisher (SGLang's ``ZmqEventPublisher``)."""

from __future__ import annotations

from typing import Any

__all__ = ["DropOneSend"]


class DropOneSend:
    """Stands in for the publisher's PUB socket and swallows one chosen seq (a lost batch).

    Install it as ``pub._pub = DropOneSend(pub._pub, drop_seq)``: the batch still enters the
    publisher's replay buffer, so a subscriber sees a gap that replay must fill.
    """

    def __init__(self, sock: Any, drop_seq: int) -> None:
        self._sock = sock
        self._drop = drop_seq.to_bytes(8, "big")

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if frames[1] == self._drop:
            return None
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
