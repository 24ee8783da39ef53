"""The ZMQ framing SGLang and vLLM share: ``[topic, seq (8 bytes, big-endian), payload]``
live, ``[b"", topic?, seq, payload]`` replayed, the replay's end marked by seq -1; and how an
event that cannot be decoded is reported. Read by the adapters' subscribers, written by the
sidecar's republisher (``sidecar/zmq_publisher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["END_SEQ", "BadEvent", "FrameError", "parse_seq", "seq_frame"]

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the replay end marker
_HEAD = 64


class FrameError(ValueError):
    """A message that is not the engine's framing or whose payload is not a batch at all."""


@dataclass(frozen=True, slots=True)
class BadEvent:
    """One event that could not be decoded: why, and its raw form (for the log)."""

    reason: str
    raw: Any


def parse_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number frame."""
    if len(frame) != 8:
        raise FrameError(
            f"sequence frame has {len(frame)} bytes, expected 8: {frame[:_HEAD].hex()}"
        )
    return int.from_bytes(frame, "big")


def seq_frame(seq: int) -> bytes:
    """The sequence number frame for ``seq`` (``parse_seq``'s inverse)."""
    return seq.to_bytes(8, "big")
