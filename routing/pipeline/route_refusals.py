"""Routes a worker's engine does not serve, as the gateway learns them from its refusals.

A worker whose engine answers a relayed route (``/v1/embeddings``, ``/v1/responses`` ...)
with its web framework's bare 404 (a plain worker), or whose sidecar says
``endpoint_refused_by_worker``, is not sent that route again for ``REFUSAL_TTL_S``; after
that the next request asks it again (an engine restarted with another model may serve it).
A request one worker refused tries the others; when every routable worker has refused the
route, the client gets 404 ``endpoint_not_served`` naming them.
"""

from __future__ import annotations

import time

__all__ = ["REFUSAL_TTL_S", "RouteRefusals"]

REFUSAL_TTL_S = 60.0


class RouteRefusals:
    """(worker, route) pairs refused lately, each until its deadline (monotonic seconds)."""

    __slots__ = ("_until", "ttl_s")

    def __init__(self, ttl_s: float = REFUSAL_TTL_S) -> None:
        self.ttl_s = ttl_s
        # Bounded: the routes are the gateway's relayed endpoints, the workers its registry's.
        self._until: dict[tuple[str, bytes], float] = {}

    def __bool__(self) -> bool:
        """Whether any refusal is remembered now (expired ones are dropped)."""
        if self._until:
            now = time.monotonic()
            for key in [k for k, until in self._until.items() if until <= now]:
                del self._until[key]
        return bool(self._until)

    def add(self, worker_id: str, path: bytes, now: float | None = None) -> None:
        """``worker_id``'s engine refused ``path``."""
        now = time.monotonic() if now is None else now
        self._until[(worker_id, path)] = now + self.ttl_s

    def refuses(self, worker_id: str, path: bytes, now: float | None = None) -> bool:
        """Whether ``worker_id`` refused ``path`` within the last ``ttl_s``."""
        until = self._until.get((worker_id, path))
        if until is None:
            return False
        if until <= (time.monotonic() if now is None else now):
            del self._until[(worker_id, path)]
            return False
        return True

    def not_served(self, path: bytes, refused: list[str], routable: list[str]) -> str | None:
        """For a request on ``path`` that found no worker left: the refusal naming the
        ``routable`` workers that refused the route lately or for this request
        (``refused``); None when none did (it is not a matter of the route)."""
        refusers = [w for w in routable if w in refused or self.refuses(w, path)]
        if not refusers:
            return None
        return (f"no worker serves POST {path.decode(errors='replace')}: the engines of "
                f"{', '.join(refusers)} refused it (each is asked again after "
                f"{self.ttl_s:g} s)")

    def of(self, worker_id: str, now: float | None = None) -> list[str]:
        """The routes ``worker_id`` refused lately (``GET /v1/workers``)."""
        now = time.monotonic() if now is None else now
        return sorted(p.decode() for (w, p), until in self._until.items()
                      if w == worker_id and until > now)
