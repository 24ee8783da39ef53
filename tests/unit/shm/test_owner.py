"""The owner in-process with real clients over its Unix socket (sync and async)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from shm import (
    AsyncBlockStoreClient,
    BlockSizeError,
    BlockStoreClient,
    BlockStoreOwner,
    ClientDetachedError,
    ForeignSegmentError,
    HeaderCorruptError,
    OwnerConfig,
    OwnerConflictError,
    ProtocolError,
    StaleDescriptorError,
    StoreFullError,
    UnknownBlockError,
)
from shm.protocol import decode_reply, encode
from tests.support.polling import wait_for
from tests.unit.shm.store_checks import check_store

BLOCK = 256  # bytes: 128 float16 elements


def config(sock_dir: Path, owner_id: str, slots: int = 8, **kw: object) -> OwnerConfig:
    return OwnerConfig(owner_id=owner_id, socket_path=sock_dir / "store.sock",
                       capacity_bytes=slots * BLOCK, block_bytes=BLOCK, dtype="float16",
                       **kw)  # type: ignore[arg-type]


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(BLOCK // 2).astype(np.float16)


async def test_put_get_round_trip_is_byte_exact(sock_dir: Path, owner_id: str) -> None:
    """Blocks put by one client come back byte-exact to another; misses are reported."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        writer = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        reader = await AsyncBlockStoreClient.connect(owner.config.socket_path,
                                                     expected_owner_id=owner_id)
        try:
            keys = [(1, 10), (1, 11), (2, 10)]
            assert await writer.put_many(keys, [block(0), block(1), block(2)]) == [True] * 3
            assert await writer.put((1, 10), block(9)) is False  # held: not overwritten
            outs = [np.empty(BLOCK // 2, np.float16) for _ in range(4)]
            hits = await reader.get_many([*keys, (3, 3)], outs)
            assert hits == [True, True, True, False]
            for i in range(3):
                assert outs[i].tobytes() == block(i).tobytes()
            assert (await reader.get((2, 10))).tobytes() == block(2).tobytes()
            with pytest.raises(UnknownBlockError, match=r"block \(3, 3\) is not in the store"):
                await reader.get((3, 3))
            async with reader.leased([(1, 11), (9, 9)]) as views:
                assert views[1] is None and views[0] is not None
                assert views[0].tobytes() == block(1).tobytes()
                assert (await reader.stats()).num_leased_blocks == 1
            assert await reader.remove_many([(1, 11), (5, 5)]) == [True, False]
            assert await reader.contains((1, 11)) is False
            assert await reader.contains_many(keys) == [True, False, True]
        finally:
            await writer.aclose()
            await reader.aclose()


async def test_large_copies_off_the_loop(sock_dir: Path, owner_id: str) -> None:
    """With a zero inline threshold copies run in a worker thread and stay exact (the get
    reads optimistically: the client knows where it put the blocks)."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path,
                                                     inline_copy_bytes=0)
        try:
            await client.put_many([(0, i) for i in range(4)], [block(i) for i in range(4)])
            outs = [np.empty(BLOCK, np.uint8) for _ in range(4)]
            assert await client.get_many([(0, i) for i in range(4)], outs) == [True] * 4
            assert all(o.tobytes() == block(i).tobytes() for i, o in enumerate(outs))
            assert (await client.stats()).num_optimistic_hits == 4
        finally:
            await client.aclose()


async def test_host_tier_events(sock_dir: Path, owner_id: str) -> None:
    """Puts, evictions and shutdown reach the listener as unstamped host-tier events."""
    events: list[KVEvent] = []
    cfg = config(sock_dir, owner_id, slots=2, worker_id="worker-7")
    async with BlockStoreOwner(cfg, listener=events.append):
        client = await AsyncBlockStoreClient.connect(cfg.socket_path)
        await client.put_many([(1, 100), (1, 101)], [block(0), block(1)],
                              parent_hashes=[None, 100], token_ids=[[1, 2], [3, 4]])
        await client.put((1, 102), block(2), parent_hash=101)
        await client.aclose()
    assert events == [
        BlockStored("worker-7", 0, 0, Tier.HOST, [100, 101], None, [1, 2, 3, 4]),
        BlockRemoved("worker-7", 0, 0, Tier.HOST, [100]),
        BlockStored("worker-7", 0, 0, Tier.HOST, [102], 101, None),
        AllBlocksCleared("worker-7", 0, 0, Tier.HOST),
    ]


async def test_published_puts_reach_the_listener_without_another_request(
        sock_dir: Path, owner_id: str) -> None:
    """A put commits by publishing in the read index, with no message: the owner's poll
    records it and sends its event though the client sends nothing more."""
    events: list[KVEvent] = []
    cfg = config(sock_dir, owner_id, slots=4)
    async with BlockStoreOwner(cfg, listener=events.append) as owner:
        client = await AsyncBlockStoreClient.connect(cfg.socket_path)
        try:
            assert client._attachment.reads_optimistically  # else it sends Publish
            assert await client.put_many([(1, 1), (1, 2)], [block(1), block(2)],
                                         parent_hashes=[None, 1]) == [True, True]
            await wait_for(lambda: bool(events), "the stored event")
            assert events == [BlockStored(cfg.effective_worker_id, 0, 0, Tier.HOST,
                                          [1, 2], None, None)]
            assert owner.stats().num_reserved == 0
        finally:
            await client.aclose()


async def test_the_poll_backs_off_and_still_finds_a_late_publication(
        sock_dir: Path, owner_id: str) -> None:
    """A writer that holds its reservation a while (a slow device copy) is polled less and
    less often, and its publication, when it comes, still reaches the listener with no
    request."""
    events: list[KVEvent] = []
    cfg = config(sock_dir, owner_id, slots=4)
    async with BlockStoreOwner(cfg, listener=events.append) as owner:
        client = await asyncio.to_thread(BlockStoreClient, cfg.socket_path)
        try:
            pending = await asyncio.to_thread(client.begin_put, [(2, 1)])
            loop = asyncio.get_running_loop()
            await wait_for(lambda: owner._poll is not None
                           and owner._poll.when() - loop.time() > 0.0015,
                           "a poll that found nothing to back off")
            assert events == []
            view = pending.views[0]
            assert view is not None
            view[:] = block(3).view(np.uint8)
            await asyncio.to_thread(pending.commit)  # publishes: no message
            await wait_for(lambda: bool(events), "the stored event")
            assert [e.block_hashes for e in events] == [[1]]  # type: ignore[attr-defined]
            await wait_for(lambda: owner._poll is None, "the poll to stop")
        finally:
            await asyncio.to_thread(client.close)


async def test_failing_listener_loses_nothing(sock_dir: Path, owner_id: str) -> None:
    """A listener that raises is counted; the put still succeeds and the store works."""
    def explode(event: KVEvent) -> None:
        raise RuntimeError("listener down")

    async with BlockStoreOwner(config(sock_dir, owner_id), listener=explode) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            assert await client.put((1, 1), block(1)) is True
            assert await client.contains_many([(1, 1)]) == [True]
            assert owner.num_listener_errors == 1
        finally:
            await client.aclose()


async def test_bad_blocks_are_refused_without_harm(sock_dir: Path, owner_id: str) -> None:
    """A wrong-sized block in a batch fails the whole batch before anything is reserved."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            with pytest.raises(BlockSizeError, match="block 1 is 254 bytes"):
                await client.put_many([(1, 1), (1, 2)], [block(1), np.zeros(127, np.float16)])
            stats = await client.stats()
            assert (stats.num_blocks, stats.num_reserved) == (0, 0)
            assert await client.put((1, 1), block(1)) is True
        finally:
            await client.aclose()


def _full_store_scenario(path: Path) -> None:
    with BlockStoreClient(path) as holder, BlockStoreClient(path) as other:
        holder.put_many([(0, i) for i in range(8)], [block(i) for i in range(8)])
        with holder.leased([(0, i) for i in range(8)]) as views:
            assert views[3] is not None and views[3].tobytes() == block(3).tobytes()
            assert not views[3].flags.writeable
            with pytest.raises(StoreFullError, match="0 evictable"):
                other.put((9, 9), block(9))
        assert other.put((9, 9), block(9)) is True  # released: evictable again


async def test_store_full_with_everything_leased(sock_dir: Path, owner_id: str) -> None:
    """With every block leased a put raises StoreFullError; after release it succeeds."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_full_store_scenario, owner.config.socket_path)
        assert owner.stats().num_leased_blocks == 0


def _pending_put_scenario(path: Path) -> None:
    with BlockStoreClient(path) as client:
        with client.begin_put([(0, 1), (0, 2)]) as pending:
            assert pending.stored == [True, True]
            for i, view in enumerate(pending.views):
                assert view is not None
                view[:] = block(i).view(np.uint8)
            assert client.contains_many([(0, 1)]) == [False]  # not before commit
        assert client.get((0, 2)).tobytes() == block(1).tobytes()
        with pytest.raises(RuntimeError), client.begin_put([(0, 3)]) as failed:
            raise RuntimeError("engine copy failed")
        assert client.contains((0, 3)) is False and client.stats().num_reserved == 0
        assert failed.stored == [False]
        with client.begin_put([(0, 4)]) as pending:  # keep a descriptor, then reuse its slot
            reply = pending._answer(pending.parts[0])
            old = (reply.slots[0], reply.generations[0])
        client.remove_many([(0, 4)])
        client.put((0, 5), block(5))
        with pytest.raises(StaleDescriptorError, match="reused"):
            client._attachment.check_generations([old[0]], [old[1]])


async def test_in_place_puts_and_generations(sock_dir: Path, owner_id: str) -> None:
    """begin_put fills slots in place, aborts on error, and reused slots fail stale checks."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_pending_put_scenario, owner.config.socket_path)


def _disconnect_scenario(path: Path) -> None:
    with BlockStoreClient(path) as watcher:
        client = BlockStoreClient(path)
        client.put_many([(0, 1), (0, 2)], [block(1), block(2)])
        held = client.leased([(0, 1), (0, 2)])
        held.__enter__()  # never exited: the client "dies" holding the leases
        client.begin_put([(0, 3)])
        assert watcher.stats().num_leased_blocks == 2
        client.close()
        with pytest.raises(ClientDetachedError, match="closed"):
            client.contains((0, 1))
        deadline = 100
        while watcher.stats().num_sessions > 1 and deadline:
            deadline -= 1
            watcher.ping()
        stats = watcher.stats()
        assert (stats.num_sessions, stats.num_leased_blocks, stats.num_reserved) == (1, 0, 0)


async def test_closed_client_gives_everything_back(sock_dir: Path, owner_id: str) -> None:
    """Closing a client releases its leases and reservations; its later calls fail."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_disconnect_scenario, owner.config.socket_path)


async def test_owner_gone_detaches_clients(sock_dir: Path, owner_id: str) -> None:
    """After the owner stops, a client's next call raises ClientDetachedError, a get too:
    the stopping owner retracts every slot, so nothing is read from the old mapping."""
    owner = BlockStoreOwner(config(sock_dir, owner_id))
    await owner.start()
    client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
    await client.put((4, 4), block(4))
    out = np.empty(BLOCK // 2, np.float16)
    assert await client.get_many([(4, 4)], [out]) == [True]  # optimistic: no owner involved
    assert (await client.stats()).num_optimistic_hits == 1
    await owner.aclose()
    with pytest.raises(ClientDetachedError):
        await client.get_many([(4, 4)], [out])
    with pytest.raises(ClientDetachedError):
        await client.ping()
    await client.aclose()
    assert not owner.config.socket_path.exists()


async def test_foreign_owner_and_corrupt_header(sock_dir: Path, owner_id: str) -> None:
    """A client expecting another owner, or finding a damaged header, refuses to attach."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        with pytest.raises(ForeignSegmentError, match="expected 'nobody'"):
            await AsyncBlockStoreClient.connect(owner.config.socket_path,
                                                expected_owner_id="nobody")
        assert owner.segment is not None
        shm = posix_ipc.SharedMemory(owner.segment.name)
        os.pwrite(shm.fd, b"garbage!", 0)
        shm.close_fd()
        with pytest.raises(HeaderCorruptError, match="magic"):
            await AsyncBlockStoreClient.connect(owner.config.socket_path)


async def test_second_owner_is_refused(sock_dir: Path, owner_id: str) -> None:
    """A second owner on the same socket, or with the same id, fails with OwnerConflictError."""
    async with BlockStoreOwner(config(sock_dir, owner_id)):
        refused = BlockStoreOwner(config(sock_dir, "other-owner"))
        with pytest.raises(OwnerConflictError, match="listening"):
            await refused.start()
        await refused.aclose()  # must not remove the live owner's socket
        assert (sock_dir / "store.sock").exists()
        other_dir = sock_dir / "b"
        other_dir.mkdir()
        with pytest.raises(OwnerConflictError, match="live owner"):
            await BlockStoreOwner(config(other_dir, owner_id)).start()


async def test_stale_socket_file_is_replaced(sock_dir: Path, owner_id: str) -> None:
    """A socket file nobody listens on (a dead owner's) is removed at start-up."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "store.sock"))
    stale.close()
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        await client.ping()
        await client.aclose()


def _garbage_scenario(path: Path) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect(str(path))
    body = b"\x92\x02\xc1"  # a Reserve-tagged array holding a byte msgpack never uses
    raw.sendall(struct.pack("<I", len(body)) + body)
    reply = raw.recv(4096)
    error = decode_reply(reply[4:])
    assert error.code == "protocol" and "bad control request" in error.message  # type: ignore[union-attr]
    release = b"\x93\x06\xc1\xc1"  # an undecodable Release gets no reply at all
    raw.sendall(struct.pack("<I", len(release)) + release + encode_ping())
    assert decode_reply(raw.recv(4096)[4:]).__class__.__name__ == "Done"
    raw.close()
    with BlockStoreClient(path) as client:
        assert client.put((1, 1), block(1)) is True


def encode_ping() -> bytes:
    from shm.protocol import Ping

    return encode(Ping())


async def test_garbage_frames_get_errors_not_crashes(sock_dir: Path, owner_id: str) -> None:
    """Undecodable requests get a protocol error (Release: none); other clients carry on."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_garbage_scenario, owner.config.socket_path)
        assert owner.num_rejected_releases == 1


def test_protocol_error_type() -> None:
    """A reply of the wrong kind is a ProtocolError, not a silent misread."""
    from shm.client._transport import expect
    from shm.protocol import Done, Flags

    with pytest.raises(ProtocolError, match="expected a Flags reply, got Done"):
        expect(Done(), Flags)


def _torch_scenario(path: Path) -> None:
    torch = pytest.importorskip("torch")
    with BlockStoreClient(path) as client:
        src = torch.randn(BLOCK // 2).to(torch.bfloat16).reshape(8, 16)
        assert client.put((4, 4), src) is True
        out = torch.empty(8, 16, dtype=torch.bfloat16)
        assert client.get((4, 4), out) is out
        assert torch.equal(out, src)


async def test_torch_tensors_through_the_store(sock_dir: Path, owner_id: str) -> None:
    """bfloat16 torch tensors go in and come out byte-exact through a bfloat16 store."""
    pytest.importorskip("torch")
    cfg = OwnerConfig(owner_id=owner_id, socket_path=sock_dir / "store.sock",
                      capacity_bytes=4 * BLOCK, block_bytes=BLOCK, dtype="bfloat16")
    async with BlockStoreOwner(cfg):
        await asyncio.to_thread(_torch_scenario, cfg.socket_path)


async def test_out_of_range_keys(sock_dir: Path, owner_id: str) -> None:
    """Keys outside unsigned 64-bit fail clearly (locally or from the owner); nothing changes."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            with pytest.raises(ValueError, match="unsigned 64-bit"):
                await client.put((1, 1 << 64), block(0))
            with pytest.raises(ProtocolError, match=">= 0"):
                await client.put((1, -5), block(0))
            stats = await client.stats()
            assert (stats.num_blocks, stats.num_reserved, stats.num_sessions) == (0, 0, 1)
        finally:
            await client.aclose()


async def test_async_in_place_put(sock_dir: Path, owner_id: str) -> None:
    """The async client fills reserved slots in place; commit publishes, an error aborts."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        client = await AsyncBlockStoreClient.connect(owner.config.socket_path)
        try:
            async with await client.begin_put([(0, 1), (0, 2)]) as pending:
                for i, view in enumerate(pending.views):
                    assert view is not None
                    view[:] = block(i).view(np.uint8)
                assert await client.contains((0, 1)) is False
            assert (await client.get((0, 2))).tobytes() == block(1).tobytes()
            with pytest.raises(RuntimeError, match="transfer failed"):
                async with await client.begin_put([(0, 3)]):
                    raise RuntimeError("transfer failed")
            stats = await client.stats()
            assert (stats.num_blocks, stats.num_reserved) == (2, 0)
        finally:
            await client.aclose()


def _bad_publish_scenario(path: Path) -> None:
    from shm.protocol import Publish

    with BlockStoreClient(path) as client:
        client._send_only(Publish([0], [12345]))  # a one-way commit of a slot never reserved
        assert client.put((1, 1), block(1)) is True  # the connection carries on


async def test_rejected_publish_is_counted(sock_dir: Path, owner_id: str) -> None:
    """A one-way commit that fails gets no reply; the owner logs and counts it."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_bad_publish_scenario, owner.config.socket_path)
        assert owner.num_rejected_commits == 1 and owner.stats().num_blocks == 1


def _grant_scenario(path: Path) -> None:
    with BlockStoreClient(path) as writer, BlockStoreClient(path) as other:
        first = [(3, h) for h in range(4)]
        assert writer.put_many(first, [block(h) for h in range(4)]) == [True] * 4
        stats = writer.stats()
        assert (stats.num_granted, stats.num_claimed) == (4, 0)  # asked for the next put
        # The second put copies into the granted slots while claiming them: no reserve.
        second = [(3, h) for h in range(4, 8)]
        assert writer.put_many(second, [block(h) for h in range(4, 8)],
                               parent_hashes=[3, 4, 5, 6]) == [True] * 4
        stats = writer.stats()
        assert (stats.num_granted, stats.num_claimed, stats.num_puts) == (4, 4, 8)
        for h in range(8):  # another client reads them byte-exact
            assert other.get((3, h)).tobytes() == block(h).tobytes()
        # A key another client wrote meanwhile: our claim of it fails, its bytes stay, and
        # the slot we filled for nothing is ours again.
        assert other.put((3, 99), block(99)) is True
        assert writer.put_many([(3, 99), (3, 100)], [block(0), block(100)]) == [False, True]
        assert other.get((3, 99)).tobytes() == block(99).tobytes()
        assert writer.get((3, 100)).tobytes() == block(100).tobytes()
        assert writer.stats().num_claimed == 5
        # Keys the writer knows the store holds are not even claimed.
        assert writer.put_many(second, [block(h) for h in range(4, 8)]) == [False] * 4
        assert writer.stats().num_claimed == 5
        # A put larger than the grant claims what it holds and reserves the rest (sent
        # together, the claimed blocks copied while the owner answers): the whole store is
        # usable by one put.
        claimed = writer.stats().num_claimed
        everything = [(4, h) for h in range(16)]
        assert writer.put_many(everything, [block(h) for h in range(16)]) == [True] * 16
        assert writer.stats().num_claimed == claimed + 4
        assert all(other.contains_many(everything))
        for h in range(16):
            assert other.get((4, h)).tobytes() == block(h).tobytes()


async def test_puts_claim_slots_granted_ahead(sock_dir: Path, owner_id: str) -> None:
    """A writer is granted slots ahead of its next put (a quarter of the store at most, by
    default), copies into them while claiming them for its keys, and reserves what a put
    needs beyond them; claims of keys the store holds fail without harm."""
    async with BlockStoreOwner(config(sock_dir, owner_id, slots=16)) as owner:
        await asyncio.to_thread(_grant_scenario, owner.config.socket_path)
        stats = owner.stats()
        assert stats.num_granted == 0 and stats.num_blocks == 16  # the writer left
        check_store(owner.store)  # type: ignore[arg-type]


def _bad_claims_scenario(path: Path) -> None:
    from shm.protocol import Claim, Slots

    with BlockStoreClient(path) as client:
        client.put((5, 1), block(1))  # asks for a grant: one slot
        slot, gen = client._granted[0], client._granted_gens[0]
        bad = [
            (Claim([5], [2], [slot], [gen + 1]), StaleDescriptorError),  # stale generation
            (Claim([5], [2], [(slot + 1) % 8], [1]), StaleDescriptorError),  # not granted
            (Claim([5, 5], [2, 3], [slot], [gen]), ProtocolError),  # 2 keys, 1 slot
            (Claim([5], [2], [slot], [gen], parents=[1, 2]), ProtocolError),
        ]
        for request, error in bad:
            with pytest.raises(error):
                client._call(request, Slots)
        stats = client.stats()
        assert (stats.num_granted, stats.num_reserved, stats.num_claimed) == (1, 0, 0)
        assert client.put((5, 2), block(2)) is True  # the grant is still good
        assert client.stats().num_claimed == 1
        assert client.get((5, 2)).tobytes() == block(2).tobytes()


async def test_bad_claims_are_refused_without_harm(sock_dir: Path, owner_id: str) -> None:
    """Claims of slots not granted, of stale generations or with lists that disagree get
    a specific error and change nothing."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_bad_claims_scenario, owner.config.socket_path)
        check_store(owner.store)  # type: ignore[arg-type]


def _claim_then_full_scenario(path: Path) -> None:
    with BlockStoreClient(path) as writer, BlockStoreClient(path) as holder:
        assert writer.put_many([(1, 0), (1, 1)], [block(0), block(1)]) == [True, True]
        assert writer.stats().num_granted == 2  # the cap: a quarter of 8 slots
        holder.put_many([(2, h) for h in range(4)], [block(h) for h in range(4)])
        with holder.leased([(1, 0), (1, 1), *[(2, h) for h in range(4)]]):
            # Two keys claimed into the granted slots, three to reserve: no room for them.
            fresh = [(3, h) for h in range(5)]
            with pytest.raises(StoreFullError):
                writer.put_many(fresh, [block(h) for h in range(5)])
            stats = writer.stats()
            assert (stats.num_reserved, stats.num_granted, stats.num_free_slots) == (0, 0, 2)
            assert holder.contains_many(fresh) == [False] * 5
        assert writer.put_many(fresh, [block(h) for h in range(5)]) == [True] * 5


async def test_a_claim_sent_with_a_reserve_that_fails_is_undone(sock_dir: Path,
                                                                  owner_id: str) -> None:
    """StoreFullError for the reserved part of a put undoes its claimed part: all or
    nothing, as for a put that reserved everything."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_claim_then_full_scenario, owner.config.socket_path)
        check_store(owner.store)  # type: ignore[arg-type]


def _read_scenario(path: Path) -> None:
    keys = [(6, 1), (6, 2)]
    with BlockStoreClient(path) as writer, BlockStoreClient(path) as reader:
        writer.put_many(keys, [block(1), block(2)])
        got: dict[int, bytes] = {}

        def copy(i: int, view: np.ndarray) -> None:
            assert not view.flags.writeable
            got[i] = view.tobytes()

        # The writer knows where its blocks are: no round trip. A miss is never copied.
        assert writer.read([*keys, (6, 9)], copy) == [True, True, False]
        assert got == {0: block(1).tobytes(), 1: block(2).tobytes()}
        assert writer.stats().num_optimistic_hits == 2
        # The reader has no hints yet: it leases, and knows where they are from then on.
        got.clear()
        assert reader.read(keys, copy) == [True, True]
        assert writer.stats().num_optimistic_hits == 2
        assert reader.read(keys, copy) == [True, True]
        assert writer.stats().num_optimistic_hits == 4
        # In-place puts leave hints too.
        with writer.begin_put([(6, 3)]) as pending:
            pending.views[0][:] = block(3).view(np.uint8)  # type: ignore[index]
        assert writer.read([(6, 3)], copy) == [True]
        assert writer.stats().num_optimistic_hits == 5

        # A block evicted while a reader copies it is reported missing, not half-read: the
        # store holds 8 blocks and another client fills it in the middle of the copy.
        def evicting_copy(i: int, view: np.ndarray) -> None:
            writer.put_many([(7, h) for h in range(8)], [block(h) for h in range(8)])
            copy(i, view)

        assert reader.read([(6, 1)], evicting_copy) == [False]


async def test_read_with_a_callers_copy(sock_dir: Path, owner_id: str) -> None:
    """read() hands read-only views to the caller's copy: without the owner where the client
    knows the place, under a lease otherwise; a block evicted mid-copy is a miss."""
    async with BlockStoreOwner(config(sock_dir, owner_id)) as owner:
        await asyncio.to_thread(_read_scenario, owner.config.socket_path)


def _threads_scenario(path: Path) -> None:
    """Four threads share one client's gets (optimistic, leasing what they miss: at most 16
    leases) while another client churns the store (32 slots, 48 keys, puts of 4 that evict):
    every hit carries the bytes of its key."""
    keys = [(8, h) for h in range(48)]
    errors: list[str] = []
    hits = [0]
    with BlockStoreClient(path) as writer, BlockStoreClient(path) as shared:
        def read_loop() -> None:
            out = [np.empty(BLOCK // 2, np.float16) for _ in range(4)]
            for n in range(150):
                batch = [keys[(3 * n + j) % 48] for j in range(4)]
                for key, hit, o in zip(batch, shared.get_many(batch, out), out, strict=True):
                    if hit:
                        hits[0] += 1
                        if o.tobytes() != block(key[1]).tobytes():
                            errors.append(f"{key} read other bytes")

        readers = [threading.Thread(target=read_loop) for _ in range(4)]
        for t in readers:
            t.start()
        try:
            for n in range(120):  # slots are retracted and reused under the readers
                batch = [keys[(4 * n + j) % 48] for j in range(4)]
                writer.put_many(batch, [block(k[1]) for k in batch])
        finally:
            for t in readers:
                t.join()
    assert not errors, errors[:3]
    assert hits[0] > 0


async def test_threads_sharing_a_client_read_exact_bytes(sock_dir: Path, owner_id: str) -> None:
    async with BlockStoreOwner(config(sock_dir, owner_id, slots=32)) as owner:
        await asyncio.to_thread(_threads_scenario, owner.config.socket_path)


def _writer_threads_scenario(path: Path) -> None:
    """Four threads put through one client (claims in flight while other threads make calls
    whose replies arrive behind theirs) and check what another client reads."""
    errors: list[str] = []
    with BlockStoreClient(path) as shared, BlockStoreClient(path) as reader:
        def write_loop(ns: int) -> None:
            for n in range(40):
                batch = [(ns, 4 * n + j) for j in range(4)]
                if shared.put_many(batch, [block(h) for _, h in batch]) != [True] * 4:
                    errors.append(f"{batch} not stored")
                shared.contains_many(batch)  # a plain call between the claims
                if not all(shared.contains_many(batch[:1])):
                    errors.append(f"{batch[0]} missing right after its put")

        writers = [threading.Thread(target=write_loop, args=(ns,)) for ns in range(4)]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        assert not errors, errors[:3]
        stats = shared.stats()
        assert stats.num_puts == 640 and stats.num_claimed > 0
        keys = [(ns, h) for ns in range(4) for h in range(160)]
        outs = [np.empty(BLOCK // 2, np.float16) for _ in keys]
        hits = reader.get_many(keys, outs)
        assert sum(hits) == stats.num_blocks
        for (_, h), hit, out in zip(keys, hits, outs, strict=True):
            assert not hit or out.tobytes() == block(h).tobytes()


async def test_threads_sharing_a_client_put_through_grants(sock_dir: Path,
                                                            owner_id: str) -> None:
    # Room for every block: with 64 slots the other threads' puts could evict a block
    # between its put and the check that it is visible (seen on a loaded host).
    async with BlockStoreOwner(config(sock_dir, owner_id, slots=1024)) as owner:
        await asyncio.to_thread(_writer_threads_scenario, owner.config.socket_path)
        check_store(owner.store)  # type: ignore[arg-type]
