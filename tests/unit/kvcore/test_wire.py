"""The wire codec: round trips are identity, anything else raises WireError only."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexSnapshot,
    Tier,
    TierBlocks,
    WorkerSnapshot,
)
from kvcore.stream import EngineLoad, ResyncRequired, StreamStart, WorkerStatus
from kvcore.wire import WIRE_VERSION, WireError, decode, encode, pack_le, unpack_le

u64 = st.integers(0, 2**64 - 1)
counters = st.integers(0, 2**63 - 1)
worker_ids = st.text(min_size=1, max_size=40)
tiers = st.sampled_from(list(Tier))


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    hashes = draw(st.lists(u64, min_size=1, max_size=8))
    per_block = draw(st.integers(1, 4))
    tokens = draw(
        st.one_of(
            st.none(),
            st.lists(
                st.integers(0, 2**32 - 1),
                min_size=per_block * len(hashes),
                max_size=per_block * len(hashes),
            ),
        )
    )
    return BlockStored(
        draw(worker_ids),
        draw(counters),
        draw(counters),
        draw(tiers),
        hashes,
        draw(st.one_of(st.none(), u64)),
        tokens,
    )


removed = st.builds(
    BlockRemoved, worker_ids, counters, counters, tiers, st.lists(u64, min_size=1, max_size=8)
)
cleared = st.builds(AllBlocksCleared, worker_ids, counters, counters, tiers)


@st.composite
def tier_blocks(draw: st.DrawFn) -> TierBlocks:
    hashes = draw(st.lists(u64, max_size=6))
    parents = draw(st.lists(st.one_of(st.none(), u64), min_size=len(hashes), max_size=len(hashes)))
    tokens = draw(st.one_of(st.just([]), st.lists(
        st.sampled_from([b"", b"\x01\x00\x00\x00" * 4, bytes(range(8))]),
        min_size=len(hashes), max_size=len(hashes))))
    return TierBlocks(draw(tiers), hashes, parents, tokens)


worker_snapshots = st.builds(
    WorkerSnapshot, worker_ids, counters, counters, st.lists(tier_blocks(), max_size=4)
)
messages = st.one_of(
    stored(),
    removed,
    cleared,
    worker_snapshots,
    st.builds(IndexSnapshot, st.lists(worker_snapshots, max_size=3), st.lists(worker_ids)),
    st.builds(
        StreamStart,
        worker_ids,
        counters,
        counters,
        st.sampled_from(["replay", "snapshot"]),
        st.integers(1, 4096),
        st.text(),
        st.sampled_from(["agg", "prefill", "decode"]),
    ),
    st.builds(
        WorkerStatus,
        worker_ids,
        counters,
        st.booleans(),
        st.text(),
        st.sampled_from(["agg", "prefill", "decode"]),
        st.one_of(st.none(), counters),
        st.one_of(
            st.none(),
            st.builds(
                EngineLoad, counters, counters, counters, st.one_of(st.none(), counters),
                counters, counters,
            ),
        ),
    ),
    st.builds(ResyncRequired, worker_ids, st.text()),
)


class TestRoundTrip:
    @settings(max_examples=300)
    @given(messages)
    def test_identity(self, message: object) -> None:
        """decode(encode(x)) == x for every message type."""
        assert decode(encode(message)) == message  # type: ignore[arg-type]

    def test_frame_starts_with_version(self) -> None:
        """A frame's first byte is the wire version."""
        assert encode(AllBlocksCleared("w", 0, 1, Tier.GPU))[0] == WIRE_VERSION


class TestGarbage:
    @settings(max_examples=1000)
    @given(st.binary(max_size=200))
    def test_arbitrary_bytes_raise_only_wire_error(self, data: bytes) -> None:
        """Any bytes either decode to a message or raise WireError, nothing else."""
        try:
            decode(data)
        except WireError:
            pass

    @settings(max_examples=500)
    @given(st.binary(max_size=200))
    def test_versioned_garbage_raises_only_wire_error(self, data: bytes) -> None:
        """Garbage behind a valid version byte also raises only WireError."""
        try:
            decode(bytes([WIRE_VERSION]) + data)
        except WireError:
            pass

    @settings(max_examples=300)
    @given(messages, st.data())
    def test_truncated_frames(self, message: object, data: st.DataObject) -> None:
        """A frame cut anywhere raises WireError."""
        frame = encode(message)  # type: ignore[arg-type]
        cut = data.draw(st.integers(0, len(frame) - 1))
        with pytest.raises(WireError):
            decode(frame[:cut])

    @pytest.mark.parametrize(
        ("payload", "reason"),
        [
            ([1, "w", 1, 2, 9, [1], None, None], "Invalid enum value 9"),
            ([1, "w", -1, 2, 0, [1], None, None], ">= 0"),
            ([1, "", 1, 2, 0, [1], None, None], "length >= 1"),
            ([1, "w", 1, 2, 0, [], None, None], "length >= 1"),
            ([1, "w", 1, 2, 0, [1, 2], None, [1, 2, 3]], "not a multiple of 2 blocks"),
            ([2, "w", 1, 2, 0, [-5]], ">= 0"),
            ([9, "w"], "Invalid value 9"),
            ([4, "w", 0, 0, [[0, [1, 2], [None]]]], "2 block hashes but 1 parents"),
        ],
    )
    def test_errors_name_what_was_wrong(self, payload: list[object], reason: str) -> None:
        """Decoding errors say what was wrong."""
        with pytest.raises(WireError, match=reason):
            decode(bytes([WIRE_VERSION]) + msgspec.msgpack.encode(payload))

    def test_wrong_version_is_named(self) -> None:
        """An unknown version byte is reported with the version expected."""
        with pytest.raises(WireError, match=f"unsupported wire version 7, expected {WIRE_VERSION}"):
            decode(b"\x07\x90")


def test_worker_status_with_engine_load_crosses_older_peers() -> None:
    """The engine load is appended to WorkerStatus: an older sidecar's status (without it)
    decodes as None, and an older gateway's WorkerStatus decodes ours, ignoring it."""
    older = msgspec.msgpack.encode([7, "w", 1, True, "", "agg", None])
    older_status = decode(bytes([WIRE_VERSION]) + older)
    assert isinstance(older_status, WorkerStatus) and older_status.engine_load is None

    class OlderWorkerStatus(msgspec.Struct, array_like=True, tag=7):
        worker_id: str
        ts_ms: int
        routable: bool = True
        reason: str = ""
        role: str = "agg"
        capacity_blocks: int | None = None

    ours = WorkerStatus("w", 1, capacity_blocks=64, engine_load=EngineLoad(1, 2, 3, 4, 5, 6))
    seen = msgspec.msgpack.decode(encode(ours)[1:], type=OlderWorkerStatus)
    assert (seen.worker_id, seen.capacity_blocks) == ("w", 64)
    assert EngineLoad(1, 2, 3, 4).view()["kv_usage"] == 0.75


def test_snapshot_token_ids_cross_older_peers() -> None:
    """Token ids are appended to TierBlocks: an older sidecar's snapshot (without them)
    decodes with none, and an older gateway's TierBlocks decodes ours, ignoring them."""
    older = msgspec.msgpack.encode([4, "w", 1, 2, [[0, [7, 8], [None, 7]]]])
    snapshot = decode(bytes([WIRE_VERSION]) + older)
    assert isinstance(snapshot, WorkerSnapshot) and snapshot.tiers[0].token_ids == []

    class OlderTierBlocks(msgspec.Struct, array_like=True):
        tier: int
        block_hashes: list[int]
        parent_hashes: list[int | None]

    ours = TierBlocks(Tier.GPU, [7, 8], [None, 7], [bytes(8), b""])
    seen = msgspec.msgpack.decode(msgspec.msgpack.encode(ours), type=OlderTierBlocks)
    assert (seen.block_hashes, seen.parent_hashes) == ([7, 8], [None, 7])


@pytest.mark.parametrize(("tokens", "reason"), [
    ([bytes(8)], "2 block hashes but token ids for 1 blocks"),
    ([bytes(8), bytes(3)], "3 bytes is not a multiple of 4"),
])
def test_snapshot_token_ids_that_do_not_fit_are_refused(tokens: list[bytes], reason: str) -> None:
    """Token ids for another number of blocks, or not whole u32s, are a WireError."""
    frame = bytes([WIRE_VERSION]) + msgspec.msgpack.encode(
        [4, "w", 1, 2, [[0, [7, 8], [None, 7], tokens]]])
    with pytest.raises(WireError, match=reason):
        decode(frame)


@settings(max_examples=50)
@given(st.data(), st.sampled_from([4, 8]))
def test_packed_uints_round_trip(data: st.DataObject, width: int) -> None:
    """unpack_le(pack_le(x)) == x for any unsigned ints of the width, empty included."""
    values = data.draw(st.lists(st.integers(0, 2 ** (8 * width) - 1), max_size=40))
    raw = pack_le(values, width)
    assert len(raw) == width * len(values)
    assert unpack_le(raw, width) == unpack_le(memoryview(raw), width) == values


def test_packed_uints_are_little_endian_whatever_the_host() -> None:
    """The bytes are little-endian (int.to_bytes(..., "little")) on any host."""
    assert pack_le([1, 0x01020304]) == bytes([1, 0, 0, 0, 4, 3, 2, 1])
    assert pack_le([0x0102030405060708], 8) == bytes(range(8, 0, -1))
    assert unpack_le(bytes([4, 3, 2, 1])) == [0x01020304]
    assert pack_le(iter([7])) == (7).to_bytes(4, "little")
    assert pack_le([]) == b"" and unpack_le(b"", 8) == []


@pytest.mark.parametrize(("values", "width", "reason"), [
    ([1, 2**32], 4, "4294967296 is not an unsigned 32-bit int"),
    ([-1], 8, "-1 is not an unsigned 64-bit int"),
    ([1, "2"], 4, "'2' is not an unsigned 32-bit int"),
])
def test_packing_what_does_not_fit_is_refused(values: list[int], width: int,
                                              reason: str) -> None:
    """A value outside the width (or no int) is a WireError naming it."""
    with pytest.raises(WireError, match=reason):
        pack_le(values, width)


@pytest.mark.parametrize(("raw", "width", "reason"), [
    (bytes(7), 4, "token ids holds 7 bytes, not a multiple of 4"),
    (bytes(12), 8, "token ids holds 12 bytes, not a multiple of 8"),
])
def test_unpacking_a_partial_int_is_refused(raw: bytes, width: int, reason: str) -> None:
    """Bytes that are not whole ints of the width are a WireError naming the column."""
    with pytest.raises(WireError, match=reason):
        unpack_le(raw, width, "token ids")


def test_only_four_and_eight_byte_uints() -> None:
    """Another width is a programming error, said as such."""
    with pytest.raises(ValueError, match="not 2"):
        pack_le([1], 2)
