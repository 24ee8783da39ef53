"""Session affinity: a client that names its session (``x-session-id``) is placed on the
worker that served the session last, while that worker is routable, not excluded and not
busy, and the session was seen within ``ttl_s``; otherwise placement decides and the session
moves with it. Bounded: the least recently used sessions go first past ``max_sessions``.

Prefix-aware placement already keeps a conversation where its blocks are; affinity is for
clients that want a session pinned regardless (their own caches, stateful adapters, or
policies that do not score overlap), and for prompts the gateway cannot hash.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SessionAffinity"]


class SessionAffinity:
    """Session id → (worker, last seen)."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000) -> None:
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError("session affinity needs ttl_s > 0 and max_sessions >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def worker_of(self, session: bytes, now: float) -> str | None:
        """The session's worker, if it was seen within the TTL."""
        entry = self._sessions.get(session)
        if entry is None:
            return None
        worker_id, seen = entry
        if now - seen > self.ttl_s:
            del self._sessions[session]
            return None
        return worker_id

    def placed(self, session: bytes, worker_id: str, now: float) -> None:
        sessions = self._sessions
        sessions[session] = (worker_id, now)
        sessions.move_to_end(session)
        if len(sessions) > self.max_sessions:
            sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)
