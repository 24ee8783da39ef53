"""Routing health: is this worker's cache visible to the gateways?

The *silent no-op* failure: an engine started without KV events (or whose publisher died)
serves requests fine, so plain health checks pass, but gateways see an empty cache and place
requests as if nothing were ever cached. ``SilenceDetector`` finds it in three steps, none of
which traffic alone can make absorbing:

1. **Evidence.** Only a request that provably made the engine store new blocks says an event
   is due: the engine reported fewer cached tokens than the prompt's cacheable blocks
   (``stores_new_blocks``), or, when it reports none, the prompt's blocks were never seen on
   this worker. A repeat of a cached prompt stores nothing, so the engine is right to be quiet.
2. **Suspicion.** Such a request with no KV event since it began, for ``silent_after_s``:
   a canary is due. The worker stays routable meanwhile.
3. **Verdict.** The canary (``sidecar.canary``) sends a prompt of fresh tokens; its blocks
   must be published within ``silent_after_s`` of its answer. None: unroutable, with the
   reason. While unroutable a canary goes every ``silent_after_s``, and the first KV event
   of anything (stored or removed) makes the worker routable again.

Pure and synchronous, with an injected clock: the canary loop drives it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RoutingHealth", "SilenceDetector", "cacheable_tokens", "stores_new_blocks"]

_REMEMBERED_PREFIXES = 4096


@dataclass(frozen=True, slots=True)
class RoutingHealth:
    routable: bool
    reason: str = ""


def cacheable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens an engine can serve from its cache: the full blocks short of the
    last token, which it always computes for the first output token (SGLang, TensorRT-LLM
    and our reference engine alike)."""
    if num_prompt_tokens < 1:
        return 0
    return (num_prompt_tokens - 1) // block_size * block_size


def stores_new_blocks(num_prompt_tokens: int, block_size: int, cached_tokens: int) -> bool:
    """Whether an engine that found ``cached_tokens`` of the prompt cached computed (and so
    stored) at least one block it can cache."""
    return cached_tokens < cacheable_tokens(num_prompt_tokens, block_size)


@dataclass(slots=True)
class _Canary:
    sent_s: float
    answered_s: float | None = None  # its blocks are stored by then: events are due


class SilenceDetector:
    """Whether the engine's KV event stream is plausibly alive (module docstring)."""

    def __init__(self, silent_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if silent_after_s <= 0:
            raise ValueError(f"silent_after_s must be > 0, got {silent_after_s}")
        self.silent_after_s = silent_after_s
        self._clock = clock
        self._last_event_s: float | None = None
        # When the earliest request that stored new blocks began, while no event came since.
        self._unseen_since_s: float | None = None
        self._canary: _Canary | None = None  # one at a time
        self._next_canary_s = -math.inf  # rate limit: none before this
        self._reason = ""  # set: unroutable until the next event
        self._listening = ""  # where the sidecar waits for events, for the reason
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.num_canaries = 0
        self.num_silent_verdicts = 0
        self.num_events = 0  # KV events heard (the engine's progress, for ``EngineWatch``)

    def now(self) -> float:
        return self._clock()

    def listening_on(self, where: str) -> None:
        """Name where the events are awaited (the endpoints, and the flag or discovery that
        chose them): a silent verdict says it, since a wrong endpoint is silent too."""
        self._listening = where

    # --- evidence ---------------------------------------------------------------------------

    def on_event(self) -> None:
        """The engine published a KV event (of any kind): its stream is alive."""
        self.num_events += 1
        self._last_event_s = self._clock()
        self._unseen_since_s = None
        self._canary = None
        self._reason = ""

    def on_served(self, started_s: float, stored_new: bool) -> None:
        """A request that began at ``started_s`` (``now()``) was answered; ``stored_new``: the
        engine provably stored new blocks for it."""
        if not stored_new:
            return
        if self._last_event_s is not None and self._last_event_s >= started_s:
            return  # events flowed while it ran
        if self._unseen_since_s is None:
            self._unseen_since_s = started_s

    def first_seen(self, prefix_hash: int) -> bool:
        """Whether a prompt whose cacheable blocks end in ``prefix_hash`` is new to this
        worker (the evidence when the engine reports no cached tokens); remembers it."""
        if prefix_hash in self._seen:
            self._seen.move_to_end(prefix_hash)
            return False
        self._seen[prefix_hash] = None
        if len(self._seen) > _REMEMBERED_PREFIXES:
            self._seen.popitem(last=False)
        return True

    # --- the re-check -----------------------------------------------------------------------

    def canary_due(self) -> bool:
        """Whether to send a canary now: silence is suspected, or the worker is unroutable
        (re-checked every ``silent_after_s``)."""
        now = self._clock()
        if self._canary is not None or now < self._next_canary_s:
            return False
        if self._reason:
            return True
        since = self._unseen_since_s
        return since is not None and now - since >= self.silent_after_s

    def canary_sent(self) -> None:
        self._canary = _Canary(self._clock())
        self.num_canaries += 1

    def canary_answered(self) -> None:
        """The engine answered the canary: its blocks are stored, their events are due."""
        if self._canary is not None:  # None: an event already came
            self._canary.answered_s = self._clock()

    def canary_failed(self) -> None:
        """The engine did not answer the canary: no verdict; another one later."""
        self._canary = None
        self._next_canary_s = self._clock() + self.silent_after_s

    def check(self) -> None:
        """Give the verdict on a canary answered ``silent_after_s`` ago with no event since."""
        canary = self._canary
        now = self._clock()
        if canary is None or canary.answered_s is None:
            return
        if now - canary.answered_s < self.silent_after_s:
            return
        self._canary = None
        self._unseen_since_s = None
        self._next_canary_s = now + self.silent_after_s
        self.num_silent_verdicts += 1
        where = f" on {self._listening}" if self._listening else ""
        self._reason = (
            f"the engine stored new KV blocks, and then a canary prompt's, but published no KV "
            f"event within {self.silent_after_s:g}s{where}: are KV events enabled "
            f"(--kv-events-config) and reachable there? A canary re-checks every "
            f"{self.silent_after_s:g}s; the first KV event makes the worker routable again"
        )

    # --- views ------------------------------------------------------------------------------

    def health(self) -> RoutingHealth:
        return RoutingHealth(False, self._reason) if self._reason else RoutingHealth(True)

    def view(self) -> dict[str, Any]:
        """The detector's state, for ``/health``."""
        now = self._clock()
        canary = self._canary
        return {
            "silent": bool(self._reason),
            "last_event_age_s": _age(now, self._last_event_s),
            "unseen_stores_age_s": _age(now, self._unseen_since_s),
            "canary": "idle" if canary is None
            else "sent" if canary.answered_s is None else "answered",
            "canaries_sent": self.num_canaries,
            "silent_verdicts": self.num_silent_verdicts,
        }


def _age(now: float, since: float | None) -> float | None:
    return None if since is None else round(now - since, 3)
