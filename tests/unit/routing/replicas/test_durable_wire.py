"""What a gateway reads from NATS with ``--events-via nats``: a JetStream message of event
frames, and an index snapshot. Valid ones read back whole; hostile bytes raise ``WireError``
only (the reader counts, logs and skips them)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from kvcore.events import BlockRemoved, BlockStored, Tier
from kvcore.stream import StreamStart, WorkerStatus
from kvcore.wire import WireError, encode, join_frames, split_frames
from routing.placement.prefix_index import PrefixIndex
from routing.replicas.durable import decode_events
from routing.replicas.snapshots import DurableSnapshot, decode_snapshot, encode_snapshot
from tests.unit.test_decoder_fuzz import mutations

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STORED = BlockStored("w0", 1, 7, Tier.GPU, [11, 12, 13], 10)
MARKER = StreamStart("w0", 1, 7, "replay", 16, "m")
MESSAGE = join_frames([encode(STORED), encode(BlockRemoved("w0", 1, 8, Tier.GPU, [13])),
                       encode(MARKER)])


def snapshot_bytes() -> bytes:
    index = PrefixIndex()
    index.apply(BlockStored("w0", 1, 1, Tier.GPU, [1, 2, 3], None))
    index.apply(BlockStored("w1", 4, 1, Tier.HOST, [1, 5], None))
    return encode_snapshot(DurableSnapshot("m", 16, 42, index.to_image()))


SNAPSHOT = snapshot_bytes()


def test_frames_join_and_split() -> None:
    """Split gives back each frame joined, in order; an empty batch has none."""
    frames = [b"a", b"", b"xyz" * 100]
    assert [bytes(f) for f in split_frames(join_frames(frames))] == frames
    assert split_frames(b"") == []


def test_a_message_reads_back() -> None:
    """Events and position markers, in order."""
    assert decode_events(MESSAGE)[0] == STORED
    assert decode_events(MESSAGE)[2] == MARKER


def test_a_status_has_no_place_in_a_message() -> None:
    """The stream carries events and markers; anything else is refused whole."""
    with pytest.raises(WireError, match="WorkerStatus"):
        decode_events(join_frames([encode(STORED), encode(WorkerStatus("w0", 1))]))


def test_a_snapshot_reads_back() -> None:
    """Model, block size, stream position and the index, loadable."""
    snapshot = decode_snapshot(SNAPSHOT)
    assert (snapshot.model_id, snapshot.block_size, snapshot.stream_seq) == ("m", 16, 42)
    index = PrefixIndex()
    index.load_image(snapshot.image)
    assert index.match_tiers([1, 5]) == {Tier.GPU: {"w0": 1}, Tier.HOST: {"w1": 2}}


@FUZZ
@given(mutations(MESSAGE))
def test_hostile_messages(raw: bytes) -> None:
    """A message that decodes applies to an index without error."""
    try:
        messages = decode_events(raw)
    except WireError:
        return
    index = PrefixIndex()
    for message in messages:
        if not isinstance(message, StreamStart):
            index.apply(message)


@FUZZ
@given(mutations(SNAPSHOT))
def test_hostile_snapshots(raw: bytes) -> None:
    """A snapshot that decodes loads whole, or is refused with the index kept."""
    try:
        snapshot = decode_snapshot(raw)
    except WireError:
        return
    index = PrefixIndex()
    try:
        index.load_image(snapshot.image)
    except WireError:
        assert index.worker_ids == []
        return
    index.match_tiers([1, 2, 3])
    index.apply(BlockStored("w9", 1, 1, Tier.GPU, [1, 2], None))


def test_snapshot_of_another_version_is_refused() -> None:
    with pytest.raises(WireError, match="version"):
        decode_snapshot(b"\x07" + msgspec.msgpack.encode([]))
