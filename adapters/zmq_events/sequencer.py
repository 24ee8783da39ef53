"""Where one publisher's stream stands, and what a seq means there (no sockets, no asyncio).

One publisher = one DP rank; seq starts at 0 and grows by 1 per batch:

* live ``seq == last + 1`` → apply; a live seq that jumps ahead → a gap, fill it by replay
  from ``last + 1``;
* a live seq at or below the last *live* seq → the publisher restarted (its counter reset):
  new epoch, then rebuild;
* a live seq at or below the last *applied* one but above the last live one → a duplicate of
  what a replay already delivered: skip;
* a replay that starts past the requested seq → the range is gone from the publisher's
  buffer: full resync (new epoch, then rebuild from whatever the buffer still holds).
"""

from __future__ import annotations

import enum

__all__ = ["RankSequencer", "SeqAction"]


class SeqAction(enum.Enum):
    APPLY = "apply"
    SKIP = "skip"
    GAP = "gap"
    RESTART = "restart"
    RANGE_GONE = "range_gone"


class RankSequencer:
    """Where one rank's stream stands: last applied seq and last seq seen live."""

    __slots__ = ("last_applied", "last_live")

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self.last_live: int | None = None

    def reset(self) -> None:
        self.last_applied = None
        self.last_live = None

    def on_live(self, seq: int) -> SeqAction:
        if self.last_live is not None and seq <= self.last_live:
            return SeqAction.RESTART
        self.last_live = seq
        return self._classify(seq)

    def on_replay(self, seq: int) -> SeqAction:
        action = self._classify(seq)
        return SeqAction.RANGE_GONE if action is SeqAction.GAP else action

    def recheck(self, seq: int) -> SeqAction:
        """Classify a live message again after a replay or resync handled its gap."""
        return self._classify(seq)

    def applied(self, seq: int) -> None:
        self.last_applied = seq

    def _classify(self, seq: int) -> SeqAction:
        last = self.last_applied
        if last is None or seq == last + 1:
            return SeqAction.APPLY
        if seq <= last:
            return SeqAction.SKIP
        return SeqAction.GAP
