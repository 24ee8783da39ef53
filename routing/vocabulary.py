"""The gateway's vocabularies: the values its string options take (``RouterConfig``'s enums,
which ``kvsidecar up`` and replay pass on too) and a plain worker's address."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvcore.jetstream import EventsVia  # shared with the sidecars, which write the events
from kvcore.logs import LogLevel  # every command's

__all__ = ["EventsVia", "FailurePolicy", "KvTransport", "LogLevel", "PdMode", "QueueOrder",
           "RouterMode", "WorkerAddress"]


class RouterMode(enum.Enum):
    """How the gateway picks a worker for a request."""

    KV = "kv"
    APPROX = "approx"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


# The disaggregation and replica vocabularies are StrEnums: their values go on unchanged to
# sidecars and into logs and metric labels, where the plain string is what is wanted.


class PdMode(enum.StrEnum):
    """How the gateway serves requests when the fleet has prefill and decode workers."""

    AUTO = "auto"  # KV handoff between our sidecars
    SGLANG = "sglang"  # the engine's own PD transfer (bootstrap room), our placement
    OFF = "off"  # aggregated workers only


class FailurePolicy(enum.StrEnum):
    """What a failed or timed-out KV handoff does to the request."""

    FAIL = "fail"
    FALLBACK = "fallback"


class KvTransport(enum.StrEnum):
    """How a decode sidecar pulls a prefill's blocks."""

    AUTO = "auto"  # shm when both sidecars share a host, else nixl (tcp when nixl is absent)
    SHM = "shm"
    NIXL = "nixl"
    TCP = "tcp"


def pull_transport(setting: str, source_host: str, target_host: str) -> str:
    """The transport ``--kv-transport`` means between two sidecars: ``auto`` is shm on one
    host, else nixl (the pulling sidecar falls back to tcp where NIXL is absent)."""
    if setting != KvTransport.AUTO:
        return setting
    return KvTransport.SHM if source_host == target_host else KvTransport.NIXL


class KvMove(enum.StrEnum):
    """Whether a lighter worker may pull a busy holder's prefix instead of recomputing or
    queueing behind it (routing/placement/kv_move.py)."""

    ON = "on"
    OFF = "off"


class QueueOrder(enum.StrEnum):
    """In what order requests waiting for a busy fleet are served, within a priority."""

    FAIR = "fair"  # by the tenants' weighted shares of tokens (start-time fair queuing)
    FCFS = "fcfs"  # first come, first served


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """A plain OpenAI-compatible engine, ``http://host:port[/prefix]``."""

    url: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> WorkerAddress:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(
                f"worker URL must start with http:// (https is not supported): {url!r}"
            )
        if not parts.hostname:
            raise ValueError(f"worker URL has no host: {url!r}")
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise ValueError(f"worker URL has a bad port: {url!r}") from exc
        if parts.query or parts.fragment:
            raise ValueError(f"worker URL must not carry a query or fragment: {url!r}")
        base = parts.path.rstrip("/")
        canonical = f"http://{parts.hostname}:{port}{base}"
        return cls(canonical, parts.hostname, port, base)
