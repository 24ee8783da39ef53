"""The block store's error types: each names what was received and what was expected.

Every error the owner raises for a client request crosses the control socket as an
``ErrorReply`` carrying the class's ``code``; the client re-raises the same class, so an
engine thread sees ``UnknownBlockError`` whether the check ran locally or in the owner.
"""

from __future__ import annotations

__all__ = [
    "BlockDtypeError",
    "BlockSizeError",
    "BlockStoreError",
    "ClientDetachedError",
    "ForeignSegmentError",
    "HeaderCorruptError",
    "OwnerConflictError",
    "ProtocolError",
    "StaleDescriptorError",
    "StoreFullError",
    "UnknownBlockError",
    "error_from_code",
]


class BlockStoreError(Exception):
    """Base of every error of the shared-memory block store."""

    code = "block_store_error"


class BlockSizeError(BlockStoreError, ValueError):
    """An array whose byte size is not the store's block size."""

    code = "block_size"


class BlockDtypeError(BlockStoreError, ValueError):
    """An array whose dtype is neither the store's dtype nor raw ``uint8`` bytes."""

    code = "block_dtype"


class UnknownBlockError(BlockStoreError, KeyError):
    """A key the store does not hold (never stored, evicted or removed)."""

    code = "unknown_block"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown block"


class StoreFullError(BlockStoreError):
    """No slot can be freed for a put: every held block is leased or being written."""

    code = "store_full"


class StaleDescriptorError(BlockStoreError):
    """A slot descriptor whose generation no longer matches the slot (it was reused)."""

    code = "stale_descriptor"


class ClientDetachedError(BlockStoreError):
    """The client was closed, or the owner went away (its socket closed)."""

    code = "client_detached"


class HeaderCorruptError(BlockStoreError):
    """A segment whose header fails its magic, version, checksum or size checks."""

    code = "header_corrupt"


class ForeignSegmentError(BlockStoreError):
    """A segment that belongs to another owner than the one expected."""

    code = "foreign_segment"


class OwnerConflictError(BlockStoreError):
    """Another live owner already uses this owner id or socket path."""

    code = "owner_conflict"


class ProtocolError(BlockStoreError):
    """A control message that does not decode, or a reply of the wrong kind."""

    code = "protocol"


_BY_CODE: dict[str, type[BlockStoreError]] = {
    cls.code: cls
    for cls in (
        BlockStoreError,
        BlockSizeError,
        BlockDtypeError,
        UnknownBlockError,
        StoreFullError,
        StaleDescriptorError,
        ClientDetachedError,
        HeaderCorruptError,
        ForeignSegmentError,
        OwnerConflictError,
        ProtocolError,
    )
}


def error_from_code(code: str, message: str) -> BlockStoreError:
    """The error instance an ``ErrorReply`` stands for (the base class for unknown codes)."""
    return _BY_CODE.get(code, BlockStoreError)(message)
