"""The disk tier below the owner's shared-memory store: the owner in-process, real clients
over its socket, real files in a temporary directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvcore.events import BlockRemoved, BlockStored, KVEvent, Tier
from shm import (
    AsyncBlockStoreClient,
    BlockNames,
    BlockStoreOwner,
    OwnerConfig,
    OwnerConflictError,
)
from shm.owner.local import LocalSession
from shm.protocol import (
    PROTOCOL_VERSION,
    Contains,
    Done,
    Flags,
    FrameReader,
    Hello,
    Lease,
    Ping,
    Slots,
    Welcome,
    decode_reply,
    encode,
)
from shm.tiers.disk_format import HEADER_BYTES, block_file_name
from tests.support.polling import wait_for

BLOCK = 256
FILE = HEADER_BYTES + BLOCK


def config(sock_dir: Path, owner_id: str, disk: Path, *, slots: int = 4,
           disk_blocks: int = 64) -> OwnerConfig:
    return OwnerConfig(owner_id=owner_id, socket_path=sock_dir / "store.sock",
                       capacity_bytes=slots * BLOCK, block_bytes=BLOCK, dtype="uint8",
                       grant_fraction=0, disk_dir=disk, disk_capacity_bytes=disk_blocks * FILE)


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def disk_events(events: list[KVEvent], kind: type[BlockStored | BlockRemoved]) -> list[int]:
    return [h for e in events if isinstance(e, kind) and e.tier == Tier.DISK
            for h in e.block_hashes]


def host_stored(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) and e.tier == Tier.HOST
            for h in e.block_hashes]


def disk_parents(events: list[KVEvent]) -> dict[int, int | None]:
    """Each disk block's parent, as the ``disk`` BlockStored events chain them."""
    out: dict[int, int | None] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.tier == Tier.DISK:
            parent = e.parent_hash
            for h in e.block_hashes:
                out[h] = parent
                parent = h
    return out


def chain(hashes: range) -> dict[int, int | None]:
    return {h: None if h == 0 else h - 1 for h in hashes}


async def put_all(client: AsyncBlockStoreClient, hashes: range) -> None:
    for h in hashes:  # one at a time: the store evicts the oldest as it fills; one chain
        assert await client.put((7, h), block(h), parent_hash=h - 1 if h else None) is True


async def on_disk(owner: BlockStoreOwner, count: int) -> None:
    assert owner.disk is not None
    disk = owner.disk
    await wait_for(lambda: disk.stats().num_pending == 0 and disk.stats().num_blocks == count,
                   f"{count} blocks written to the disk tier")


async def test_evicted_blocks_spill_to_disk_and_come_back_byte_exact(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    async with BlockStoreOwner(config(sock_dir, owner_id, tmp_path / "disk"),
                               listener=events.append) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(10))  # 4 slots: blocks 0..5 are evicted
            await on_disk(owner, 6)
            assert sorted(disk_events(events, BlockStored)) == list(range(6))
            assert disk_parents(events) == chain(range(6))  # the parents travel with them
            assert sorted(p.name for p in (tmp_path / "disk").glob("*.blk")) == sorted(
                block_file_name((7, h)) for h in range(6))
            assert await client.contains((7, 2)) is True  # shm misses it, disk holds it
            before = len(host_stored(events))
            out = np.empty(BLOCK, np.uint8)
            assert (await client.get((7, 2), out)).tobytes() == block(2).tobytes()
            stats = await client.stats()
            assert stats.num_disk_reads == 1 and stats.num_disk_writes >= 6
            assert 2 in host_stored(events)[before:]  # promoted: a host block again
            # The promoted block is in shared memory now: read again, no disk read.
            assert (await client.get((7, 2))).tobytes() == block(2).tobytes()
            assert (await client.stats()).num_disk_reads == 1
            # Several at once, with a miss and shm hits among them.
            outs = [np.empty(BLOCK, np.uint8) for _ in range(4)]
            hits = await client.get_many([(7, 0), (7, 9), (7, 99), (7, 1)], outs)
            assert hits == [True, True, False, True]
            for out, h in zip([outs[0], outs[1], outs[3]], (0, 9, 1), strict=True):
                assert out.tobytes() == block(h).tobytes()
        finally:
            await client.aclose()


async def test_blocks_keyed_by_engine_hashes_keep_their_names_on_disk(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    """With engine keys, disk events name blocks canonically (the names the engine's events
    gave), a restart re-announces them from the files' headers alone, and a promoted block's
    host event is named too; a block never named is kept, never announced."""
    disk = tmp_path / "disk"
    canonical = {h: 1000 + h for h in range(10)}
    names = BlockNames("w", canonical_keys=False)
    names.learn(range(8), [canonical[h] for h in range(8)], None)  # 8 and 9: never
    events: list[KVEvent] = []
    async with BlockStoreOwner(config(sock_dir, owner_id, disk), listener=events.append,
                               names=names) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(10))  # 4 slots: blocks 0..5 are evicted
            await on_disk(owner, 6)
        finally:
            await client.aclose()
        assert disk_parents(events) == {canonical[h]: canonical.get(h - 1) for h in range(6)}
        assert sorted(host_stored(events)) == [canonical[h] for h in range(8)]
    events = []
    async with BlockStoreOwner(config(sock_dir, owner_id, disk), listener=events.append,
                               names=BlockNames("w", canonical_keys=False)) as owner:
        assert disk_parents(events) == {canonical[h]: canonical.get(h - 1) for h in range(6)}
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            assert (await client.get((7, 2))).tobytes() == block(2).tobytes()
        finally:
            await client.aclose()
        promoted = [e for e in events if isinstance(e, BlockStored) and e.tier == Tier.HOST]
        assert [(e.block_hashes, e.parent_hash) for e in promoted] == [([1002], 1001)]


async def test_a_restart_reannounces_the_disk_tier(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    async with BlockStoreOwner(config(sock_dir, owner_id, disk)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(8))
            await on_disk(owner, 4)
        finally:
            await client.aclose()
    (disk / "00000000000000aa-00000000000000bb.blk.tmp").write_bytes(b"torn")  # a crash's
    events: list[KVEvent] = []
    async with BlockStoreOwner(config(sock_dir, owner_id, disk),
                               listener=events.append) as owner:
        assert sorted(disk_events(events, BlockStored)) == [0, 1, 2, 3]
        assert disk_parents(events) == chain(range(4))  # kept in the files' headers
        assert not list(disk.glob("*.tmp"))
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            for h in range(4):
                assert (await client.get((7, h))).tobytes() == block(h).tobytes()
            assert await client.get_many([(7, 5)], [np.empty(BLOCK, np.uint8)]) == [False]
        finally:
            await client.aclose()


async def test_a_corrupt_block_is_dropped_and_missed(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    disk = tmp_path / "disk"
    async with BlockStoreOwner(config(sock_dir, owner_id, disk),
                               listener=events.append) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(6))
            await on_disk(owner, 2)
            path = disk / block_file_name((7, 1))
            raw = bytearray(path.read_bytes())
            raw[HEADER_BYTES + 17] ^= 0x01  # one flipped bit in the payload
            path.write_bytes(bytes(raw))
            out = np.zeros(BLOCK, np.uint8)
            assert await client.get_many([(7, 1)], [out]) == [False]
            stats = await client.stats()
            assert stats.num_disk_corrupt == 1 and stats.num_disk_reads == 0
            assert disk_events(events, BlockRemoved) == [1]
            assert await client.contains((7, 1)) is False
            assert owner.disk is not None and not owner.disk.contains((7, 1))
            await wait_for(lambda: not path.exists(), "the corrupt file to be unlinked")
            # The sound one still reads back.
            assert (await client.get((7, 0))).tobytes() == block(0).tobytes()
        finally:
            await client.aclose()


async def test_the_disk_capacity_evicts_least_recently_used(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    disk = tmp_path / "disk"
    async with BlockStoreOwner(config(sock_dir, owner_id, disk, disk_blocks=3),
                               listener=events.append) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(7))  # evicts 0, 1, 2 to disk
            await on_disk(owner, 3)
            # A read makes block 0 recent on disk (and promotes it, evicting 3 from shm).
            assert (await client.get((7, 0))).tobytes() == block(0).tobytes()
            await on_disk(owner, 3)
            assert await client.put((7, 100), block(100)) is True  # evicts 4 from shm
            await on_disk(owner, 3)
            removed = disk_events(events, BlockRemoved)
            assert removed == [1, 2]  # 0 was read since: it stays
            assert sorted(p.name for p in disk.glob("*.blk")) != []
            await wait_for(lambda: len(list(disk.glob("*.blk"))) == 3,
                           "the disk tier to unlink what it evicted")
            held = [h for h in (0, 1, 2, 3, 4) if (disk / block_file_name((7, h))).exists()]
            assert held == [0, 3, 4]
        finally:
            await client.aclose()


async def test_remove_drops_disk_blocks_too(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    disk = tmp_path / "disk"
    async with BlockStoreOwner(config(sock_dir, owner_id, disk),
                               listener=events.append) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(5))
            await on_disk(owner, 1)
            assert await client.remove_many([(7, 0), (7, 4), (7, 50)]) == [True, True, False]
            assert disk_events(events, BlockRemoved) == [0]
            assert await client.get_many([(7, 0)], [np.empty(BLOCK, np.uint8)]) == [False]
        finally:
            await client.aclose()


async def test_one_directory_per_owner(sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    async with BlockStoreOwner(config(sock_dir, owner_id, disk)):
        other = OwnerConfig(owner_id=owner_id + "b", socket_path=sock_dir / "other.sock",
                            capacity_bytes=4 * BLOCK, block_bytes=BLOCK, disk_dir=disk,
                            disk_capacity_bytes=8 * FILE)
        with pytest.raises(OwnerConflictError, match="disk tier"):
            async with BlockStoreOwner(other):
                pass
        assert not (sock_dir / "other.sock").exists()


def test_config_checks_the_disk_flags(sock_dir: Path) -> None:
    with pytest.raises(ValueError, match="at least one block file"):
        OwnerConfig(owner_id="x", socket_path=sock_dir / "s.sock", capacity_bytes=BLOCK,
                    block_bytes=BLOCK, disk_dir=sock_dir, disk_capacity_bytes=BLOCK)
    with pytest.raises(ValueError, match="needs a disk tier directory"):
        OwnerConfig(owner_id="x", socket_path=sock_dir / "s.sock", capacity_bytes=BLOCK,
                    block_bytes=BLOCK, disk_capacity_bytes=10 * FILE)


async def test_an_in_process_session_reads_through_disk_too(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    """The sidecar's own session (the transfer service's, ``LocalSession``) gets a disk block
    promoted before its lease's reply, as a client does."""
    async with BlockStoreOwner(config(sock_dir, owner_id, tmp_path / "disk")) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(6))
            await on_disk(owner, 2)
        finally:
            await client.aclose()
        with LocalSession(owner) as local:
            reply = local.lease([(7, 0), (7, 5), (7, 77)])
            assert reply.slots[2] is None and None not in reply.slots[:2]
            for slot, h in zip(reply.slots[:2], (0, 5), strict=True):
                assert local.rows[slot].tobytes() == block(h).tobytes()
            local.release([s for s in reply.slots if s is not None],
                          [g for g in reply.generations if g is not None])
        assert owner.stats().num_disk_reads == 1


async def _frames(reader: asyncio.StreamReader, count: int) -> list[object]:
    frames = FrameReader()
    bodies: list[bytes] = []
    while len(bodies) < count:
        chunk = await reader.read(65536)
        assert chunk, "the owner closed the connection"
        bodies += frames.feed(chunk)
    return [decode_reply(body) for body in bodies]


async def test_a_deferred_lease_keeps_the_connections_order(
        sock_dir: Path, owner_id: str, tmp_path: Path) -> None:
    """Frames sent behind a lease that reads the disk are answered after it, in order; a
    client that leaves while its lease reads the disk leaves nothing held."""
    async with BlockStoreOwner(config(sock_dir, owner_id, tmp_path / "disk")) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            await put_all(client, range(8))
            await on_disk(owner, 4)
            path = str(owner.config.socket_path)
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(b"".join(encode(m) for m in (
                Hello(PROTOCOL_VERSION, 1), Lease([7], [1]), Contains([7, 7], [1, 99]), Ping())))
            welcome, slots, flags, done = await _frames(reader, 4)
            assert isinstance(welcome, Welcome) and isinstance(done, Done)
            assert isinstance(slots, Slots) and slots.slots[0] is not None
            assert isinstance(flags, Flags) and flags.values == [True, False]
            writer.close()
            await writer.wait_closed()
            # A client gone before its deferred reply: the owner finishes and frees it all.
            reader, gone = await asyncio.open_unix_connection(path)
            gone.write(encode(Hello(PROTOCOL_VERSION, 2)))
            assert isinstance((await _frames(reader, 1))[0], Welcome)
            gone.write(encode(Lease([7], [2])))
            gone.close()  # before the reply
            await wait_for(lambda: owner.stats().num_disk_reads == 2, "the second promotion")
            await wait_for(lambda: owner.stats().num_leased_blocks == 0
                           and owner.stats().num_reserved == 0, "nothing left held")
            assert (await client.get((7, 2))).tobytes() == block(2).tobytes()
        finally:
            await client.aclose()
