"""Where durable KV events live on NATS JetStream (``--events-via nats``): the names that
sidecars (writers) and gateways (readers) must agree on, and nothing that talks to NATS.

One stream per model holds every worker's canonical event frames, one subject per worker;
one object-store bucket per model holds the gateways' index snapshots. Model and worker
names are made valid tokens (anything but letters, digits, ``_`` and ``-`` becomes ``_``);
the frames carry the real worker id, the subject only routes.
"""

from __future__ import annotations

import enum
import re

__all__ = ["EventsVia", "events_subject", "events_subjects", "snapshot_bucket", "stream_name"]



class EventsVia(enum.StrEnum):
    """Where KV events travel (``--events-via`` of the sidecar, which writes them, and of the
    gateway, which reads them)."""

    DIRECT = "direct"  # each sidecar's own HTTP stream, alone
    NATS = "nats"  # also the model's JetStream stream (sidecar/jetstream_publisher.py)


_INVALID = re.compile(r"[^A-Za-z0-9_-]")


def _token(name: str) -> str:
    return _INVALID.sub("_", name) or "_"


def stream_name(model_id: str) -> str:
    """The model's event stream: ``KVSIDECAR_EVENTS_<model>``."""
    return f"KVSIDECAR_EVENTS_{_token(model_id)}"


def events_subject(model_id: str, worker_id: str) -> str:
    """One worker's events: ``kvsidecar.events.<model>.<worker>``."""
    return f"kvsidecar.events.{_token(model_id)}.{_token(worker_id)}"


def events_subjects(model_id: str) -> str:
    """Every worker of the model (the stream's subjects, a gateway's filter)."""
    return f"kvsidecar.events.{_token(model_id)}.*"


def snapshot_bucket(model_id: str) -> str:
    """The object-store bucket of the model's index snapshots."""
    return f"KVSIDECAR_SNAPSHOTS_{_token(model_id)}"
