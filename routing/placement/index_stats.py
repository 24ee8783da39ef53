"""What the prefix index counts about its input: outcomes of ``apply`` and unusual events."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ApplyOutcome", "IndexStats"]


class ApplyOutcome(enum.Enum):
    """What ``PrefixIndex.apply`` did with an event."""

    APPLIED = "applied"
    NEW_EPOCH = "new_epoch"  # the worker restarted: its blocks were cleared, then applied
    GAP = "gap"  # applied, but events were missed before it: the worker needs a resync
    DUPLICATE = "duplicate"  # seq already applied (a replay overlap or out-of-order): dropped
    STALE_EPOCH = "stale_epoch"  # from an epoch older than the worker's current one: dropped


@dataclass(slots=True)
class IndexStats:
    """Counters of everything unusual the index has seen (never reset)."""

    events_applied: int = 0
    events_duplicate: int = 0
    events_stale_epoch: int = 0
    gaps: int = 0
    new_epochs: int = 0
    duplicate_blocks: int = 0  # stored blocks the worker already held
    unknown_removals: int = 0  # removed blocks the worker did not hold
    self_parented_blocks: int = 0  # corrupt: a block named as its own parent (skipped)
