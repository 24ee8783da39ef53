"""Transfer errors and wire messages: codes round-trip, bad input gets a specific error."""

from __future__ import annotations

import pytest

from sidecar.transfer import (
    BadTransferRequestError,
    BlockFormatMismatchError,
    ExportGoneError,
    NoRoomError,
    PeerUnavailableError,
    TransferConfig,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownBlocksError,
)
from sidecar.transfer.errors import error_body, error_from_body
from sidecar.transfer.messages import ExportRequest, Transport, decode, encode

ALL = [BadTransferRequestError, BlockFormatMismatchError, ExportGoneError, NoRoomError,
       PeerUnavailableError, TransferTimeoutError, TransportUnavailableError, TransferError]


@pytest.mark.parametrize("cls", ALL)
def test_error_round_trips_through_its_wire_body(cls: type[TransferError]) -> None:
    """Each error class comes back as itself, with its message, from its JSON body."""
    back = error_from_body(cls.status, error_body(cls("what went wrong")))
    assert type(back) is cls
    assert str(back) == "what went wrong"


def test_unknown_blocks_error_keeps_the_missing_keys() -> None:
    """The keys the exporter lacks survive the round trip."""
    missing = [(1, 2), (3, (1 << 64) - 1)]
    back = error_from_body(404, error_body(UnknownBlocksError("gone", missing)))
    assert isinstance(back, UnknownBlocksError)
    assert back.missing == missing


def test_a_reply_without_an_error_object_is_a_generic_transfer_error() -> None:
    """A proxy's HTML error page, say, still becomes a TransferError that names the status."""
    back = error_from_body(502, None)
    assert type(back) is TransferError
    assert "502" in str(back)


def test_export_request_round_trips() -> None:
    """An export request decodes to what was encoded, u64 keys included."""
    req = ExportRequest([(0, (1 << 64) - 1)], Transport.TCP, 4096, "bfloat16", 1.5)
    assert decode(encode(req), ExportRequest) == req


@pytest.mark.parametrize("raw", [
    b"not json",
    b'{"keys": [[1, 2]], "transport": "carrier-pigeon", "block_bytes": 4, "dtype": "uint8", '
    b'"ttl_s": 1}',
    b'{"keys": [[-1, 2]], "transport": "shm", "block_bytes": 4, "dtype": "uint8", "ttl_s": 1}',
    b'{"keys": [[1]], "transport": "shm", "block_bytes": 4, "dtype": "uint8", "ttl_s": 1}',
    b'{"keys": [[1, 2]], "transport": "shm", "block_bytes": 0, "dtype": "uint8", "ttl_s": 1}',
    b'{"keys": [[1, 2]], "transport": "shm", "block_bytes": 4, "dtype": "uint8", "ttl_s": 0}',
    b'{"keys": [[1, 2]], "transport": "shm", "block_bytes": 4, "dtype": "uint8", "ttl_s": 1, '
    b'"extra": true}',
])
def test_bad_export_requests_raise_bad_request(raw: bytes) -> None:
    """Malformed JSON, unknown transports, negative or short keys, bad sizes: all 400s."""
    with pytest.raises(BadTransferRequestError):
        decode(raw, ExportRequest)


@pytest.mark.parametrize("fields", [
    {"tcp_port": 70000}, {"lease_ttl_s": 0}, {"pull_timeout_s": -1},
    {"max_blocks_per_pull": 0}, {"socket_buffer_bytes": 1024},
])
def test_bad_config_is_refused(fields: dict[str, object]) -> None:
    """Each out-of-range setting raises ValueError naming it."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        TransferConfig(**fields)  # type: ignore[arg-type]
