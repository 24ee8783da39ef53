"""Routing health: is this worker's cache visible to the gateways?

The *silent no-op* failure: an engine started without KV events (or whose publisher died)
serves requests fine, so plain health checks pass, but gateways see an empty cache and place
requests as if nothing were ever cached. We flag it: when requests sharing prefixes keep
arriving and the engine has published no KV event for ``silent_after_s``, the worker is
reported unroutable, with the reason, until events flow again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RoutingHealth", "SilenceDetector"]

_SHARED_PREFIX_REQUESTS = 2  # requests re-using a seen prefix before silence is suspicious
_REMEMBERED_PREFIXES = 4096


@dataclass(frozen=True, slots=True)
class RoutingHealth:
    routable: bool
    reason: str = ""


class SilenceDetector:
    """Watches events and requests; says whether the event stream is plausibly alive."""

    def __init__(self, silent_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.silent_after_s = silent_after_s
        self._clock = clock
        self._last_event = clock()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._shared_since_event = 0

    def on_event(self) -> None:
        self._last_event = self._clock()
        self._shared_since_event = 0

    def on_request(self, first_block_hash: int | None) -> None:
        """A request was proxied; ``first_block_hash`` identifies its first full block."""
        if first_block_hash is None:
            return
        if first_block_hash in self._seen:
            self._seen.move_to_end(first_block_hash)
            self._shared_since_event += 1
            return
        self._seen[first_block_hash] = None
        if len(self._seen) > _REMEMBERED_PREFIXES:
            self._seen.popitem(last=False)

    def health(self) -> RoutingHealth:
        quiet_s = self._clock() - self._last_event
        if self._shared_since_event >= _SHARED_PREFIX_REQUESTS and quiet_s >= self.silent_after_s:
            return RoutingHealth(
                False,
                f"served {self._shared_since_event} requests sharing cached prefixes but the "
                f"engine published no KV event for {quiet_s:.0f}s: are KV events enabled "
                "(--kv-events-config) and reachable?",
            )
        return RoutingHealth(True)
