"""Segments: names, mode, header checks, owner checks and stale clean-up in /dev/shm."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator

import posix_ipc
import pytest

from shm.errors import ForeignSegmentError, HeaderCorruptError, OwnerConflictError
from shm.segment import (
    HEADER_BYTES,
    Segment,
    SegmentHeader,
    segments_of,
    unlink_stale_segments,
)


@pytest.fixture
def owner_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def segment(owner_id: str) -> Iterator[Segment]:
    with Segment.create(owner_id, block_bytes=1000, num_slots=3, dtype="float16",
                        layout="layer_first") as seg:
        yield seg


def _write_raw(name: str, offset: int, data: bytes) -> None:
    shm = posix_ipc.SharedMemory(name)
    try:
        os.pwrite(shm.fd, data, offset)
    finally:
        shm.close_fd()


class TestCreate:
    def test_name_mode_and_layout(self, segment: Segment, owner_id: str) -> None:
        """The segment is /kvsidecar-<owner>-data-<uuid8>, mode 0600, slots 512-aligned."""
        assert segment.name.startswith(f"/kvsidecar-{owner_id}-data-")
        assert len(segment.name.rsplit("-", 1)[1]) == 8
        info = os.stat(f"/dev/shm{segment.name}")
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert segment.slots.shape == (3, 1024)
        assert info.st_size == segment.header.segment_bytes
        assert segments_of(owner_id) == [segment.name]

    def test_attach_sees_the_owners_bytes(self, segment: Segment, owner_id: str) -> None:
        """An attacher maps the same memory and reads the same header."""
        segment.slots[2, :4] = [1, 2, 3, 4]
        attached = Segment.attach(segment.name, owner_id)
        try:
            assert attached.header == segment.header
            assert attached.slots[2, :4].tolist() == [1, 2, 3, 4]
            with pytest.raises(PermissionError):
                attached.unlink()
        finally:
            attached.close()

    def test_exit_unlinks(self, owner_id: str) -> None:
        """Leaving the owner's context unmaps and unlinks the segment."""
        with Segment.create(owner_id, block_bytes=64, num_slots=1, dtype="uint8",
                            layout="raw") as seg:
            name = seg.name
        assert not os.path.exists(f"/dev/shm{name}")

    def test_bad_owner_id(self) -> None:
        """An owner id that cannot be part of a segment name is refused."""
        with pytest.raises(ValueError, match="owner id"):
            Segment.create("a/b", block_bytes=64, num_slots=1, dtype="uint8", layout="raw")


class TestHeader:
    def test_round_trip(self) -> None:
        """pack/unpack keep every field."""
        header = SegmentHeader(4096, 10, "bfloat16", "page_first", "w-1", 123, 456)
        raw = header.pack().ljust(HEADER_BYTES, b"\0")
        assert SegmentHeader.unpack(raw, "/x", header.segment_bytes) == header

    @pytest.mark.parametrize(
        ("offset", "data", "message"),
        [
            (0, b"XXXXXXXX", "magic"),
            (8, b"\x09\x00", "header version 9"),
            (24, b"\xff", "checksum"),
        ],
    )
    def test_corruption_is_detected(
        self, segment: Segment, owner_id: str, offset: int, data: bytes, message: str
    ) -> None:
        """A damaged magic, version or body fails attach with HeaderCorruptError."""
        _write_raw(segment.name, offset, data)
        with pytest.raises(HeaderCorruptError, match=message):
            Segment.attach(segment.name, owner_id)

    def test_too_small_segment(self, owner_id: str) -> None:
        """A segment shorter than a header (a crash mid-create) is corrupt, not a crash."""
        name = f"/kvsidecar-{owner_id}-data-0badf00d"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=100)
        shm.close_fd()
        try:
            with pytest.raises(HeaderCorruptError, match="too small"):
                Segment.attach(name)
        finally:
            posix_ipc.unlink_shared_memory(name)

    def test_foreign_owner(self, segment: Segment) -> None:
        """Attaching with another owner id than the header's raises ForeignSegmentError."""
        with pytest.raises(ForeignSegmentError, match="belongs to owner"):
            Segment.attach(segment.name, "someone-else")


class TestStale:
    def test_dead_owners_segments_are_unlinked(self, owner_id: str) -> None:
        """A segment whose owner is gone (lock free) is unlinked at the next start-up."""
        seg = Segment.create(owner_id, block_bytes=64, num_slots=1, dtype="uint8", layout="raw")
        seg.close()  # closing the descriptor drops the owner lock, as dying does
        assert unlink_stale_segments(owner_id) == [seg.name]
        assert segments_of(owner_id) == []

    def test_live_owner_is_a_conflict(self, segment: Segment, owner_id: str) -> None:
        """A segment whose owner still holds its lock is never unlinked."""
        with pytest.raises(OwnerConflictError, match="live owner"):
            unlink_stale_segments(owner_id)
        assert segments_of(owner_id) == [segment.name]

    def test_other_owners_are_left_alone(self, owner_id: str) -> None:
        """Owner 'x' does not touch owner 'x-b''s segments, even if they are stale."""
        other = Segment.create(f"{owner_id}-b", block_bytes=64, num_slots=1, dtype="uint8",
                               layout="raw")
        other.close()
        try:
            assert unlink_stale_segments(owner_id) == []
            assert segments_of(f"{owner_id}-b") == [other.name]
        finally:
            posix_ipc.unlink_shared_memory(other.name)
