"""Block transfer errors: one class per way a pull can fail, each with a wire code.

The exporter answers a bad request with an HTTP status and a JSON body in the OpenAI error
shape, ``{"error": {"message", "type", "code", ...}}``; the importer turns the code back
into the same class, so a caller of ``pull`` sees ``UnknownBlocksError`` whether the
exporter or the importer found the problem. Every failed pull leaves nothing visible in
the importer's store.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadTransferRequestError",
    "BlockFormatMismatchError",
    "ExportGoneError",
    "NoRoomError",
    "PeerUnauthorizedError",
    "PeerUnavailableError",
    "TransferError",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "UnknownBlocksError",
    "error_body",
    "error_from_body",
]


class TransferError(Exception):
    """Base of every block transfer error; ``code`` names it on the wire."""

    code = "transfer_error"
    status = 500
    kind = "server_error"

    def to_wire(self) -> dict[str, Any]:
        return {"message": str(self), "type": self.kind, "code": self.code}


class BadTransferRequestError(TransferError):
    """A malformed export request: bad JSON, bad keys, unknown transport, too many blocks."""

    code = "bad_request"
    status = 400
    kind = "invalid_request_error"


class UnknownBlocksError(TransferError):
    """The exporter does not hold some of the keys asked for (never stored or evicted)."""

    code = "unknown_blocks"
    status = 404
    kind = "invalid_request_error"

    def __init__(self, message: str, missing: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "missing": [list(k) for k in self.missing]}


class BlockFormatMismatchError(TransferError):
    """The two stores disagree on block size or dtype, so a block cannot move as is."""

    code = "block_format_mismatch"
    status = 409
    kind = "invalid_request_error"


class ExportGoneError(TransferError):
    """The export is unknown or its leases lapsed: its bytes cannot be trusted."""

    code = "export_gone"
    status = 410
    kind = "invalid_request_error"


class TransportUnavailableError(TransferError):
    """The transport cannot work here: NIXL not installed, or the segment not on this host."""

    code = "transport_unavailable"
    status = 501
    kind = "server_error"


class PeerUnavailableError(TransferError):
    """The peer cannot be reached, or went away mid-pull."""

    code = "peer_unavailable"
    status = 503
    kind = "server_error"


class PeerUnauthorizedError(TransferError):
    """The peer refused this sidecar's control token (``--control-token-file`` differs)."""

    code = "peer_unauthorized"
    status = 502
    kind = "server_error"


class TransferTimeoutError(TransferError):
    """The pull did not finish within its deadline (nothing was imported)."""

    code = "transfer_timeout"
    status = 504
    kind = "server_error"


class NoRoomError(TransferError):
    """The importer's store cannot reserve slots: everything is leased or being written."""

    code = "no_room"
    status = 507
    kind = "server_error"


_BY_CODE: dict[str, type[TransferError]] = {
    cls.code: cls
    for cls in (
        TransferError,
        BadTransferRequestError,
        UnknownBlocksError,
        BlockFormatMismatchError,
        ExportGoneError,
        TransportUnavailableError,
        PeerUnavailableError,
        PeerUnauthorizedError,
        TransferTimeoutError,
        NoRoomError,
    )
}


def error_body(exc: TransferError) -> dict[str, Any]:
    """The JSON body of an HTTP error reply."""
    return {"error": exc.to_wire()}


def error_from_body(status: int, body: Any) -> TransferError:
    """The error an exporter's reply stands for (``TransferError`` when it names none)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if status in (401, 403):
        why = detail.get("message") if isinstance(detail, dict) else None
        return PeerUnauthorizedError(
            f"the peer refused this sidecar's control token (HTTP {status}): "
            f"{why or 'no reason given'}; give both sides the same --control-token-file")
    if not isinstance(detail, dict):
        return TransferError(f"peer answered HTTP {status} without an error object")
    message = str(detail.get("message", f"HTTP {status}"))
    cls = _BY_CODE.get(str(detail.get("code")), TransferError)
    if cls is UnknownBlocksError:
        raw = detail.get("missing")
        missing = [(int(k[0]), int(k[1])) for k in raw] if isinstance(raw, list) else []
        return UnknownBlocksError(message, missing)
    return cls(message)
