"""The gateway side of kvsidecar: prefix index, placement scorer, load accounting.

Never imports torch, posix_ipc, shm or an engine package (DESIGN.md, package boundaries).
"""

from routing.active_load import ActiveLoad, UnknownRequestError
from routing.kv_router import KvRouter
from routing.pending import PendingPrefixes
from routing.prefix_index import ApplyOutcome, IndexStats, PrefixIndex
from routing.scorer import (
    Candidate,
    Placement,
    Pool,
    Scorer,
    ScoringWeights,
    TierOverlap,
    WorkerLoad,
)

__all__ = [
    "ActiveLoad",
    "ApplyOutcome",
    "Candidate",
    "IndexStats",
    "KvRouter",
    "PendingPrefixes",
    "Placement",
    "Pool",
    "PrefixIndex",
    "Scorer",
    "ScoringWeights",
    "TierOverlap",
    "UnknownRequestError",
    "WorkerLoad",
]
