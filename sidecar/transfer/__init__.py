"""Sidecar-to-sidecar KV block export and import: shared memory, NIXL, or TCP.

``BlockTransferService`` is what the sidecar embeds beside its ``BlockStoreOwner``; see
``sidecar/transfer/service.py`` for the pull protocol and the routes it serves.
"""

from sidecar.transfer.config import TransferConfig
from sidecar.transfer.errors import (
    BadTransferRequestError,
    BlockFormatMismatchError,
    ExportGoneError,
    NoRoomError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownBlocksError,
)
from sidecar.transfer.messages import ExportOffer, ExportRequest, PullResult, Transport
from sidecar.transfer.service import BlockTransferService
from sidecar.transfer.stats import PullRecord, TransferStats, TransportStats

__all__ = [
    "BadTransferRequestError",
    "BlockFormatMismatchError",
    "BlockTransferService",
    "ExportGoneError",
    "ExportOffer",
    "ExportRequest",
    "NoRoomError",
    "PeerUnavailableError",
    "PullRecord",
    "PullResult",
    "TransferConfig",
    "TransferError",
    "TransferStats",
    "TransferTimeoutError",
    "Transport",
    "TransportStats",
    "TransportUnavailableError",
    "UnknownBlocksError",
]
