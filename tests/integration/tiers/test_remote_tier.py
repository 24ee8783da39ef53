"""The remote tier on a real ``redis-server``: two store owners (two replicas of one model)
share blocks through it; what the store holds reaches both indexes, evictions under
``maxmemory`` included; a corrupt value is a miss; the store killed mid-load is a miss,
never a failed get, and the tier comes back with the store."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvcore.events import BlockStored, KVEvent, Tier
from kvsidecar.local_redis import RedisServer, redis_command
from shm import AsyncBlockStoreClient, BlockNames, BlockStoreClient, BlockStoreOwner, OwnerConfig
from tests.support.polling import wait_for, wait_until
from tests.support.store_owner import OwnerThread, owner_config

BLOCK = 64 << 10


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def chain(n: int, start: int = 100, ns: int = 7) -> tuple[list[tuple[int, int]], list[int | None]]:
    keys = [(ns, start + i) for i in range(n)]
    return keys, [None] + [k[1] for k in keys[:-1]]


def replica(sock_dir: Path, url: str, slots: int = 32, **kw: object) -> OwnerConfig:
    return replace(owner_config(sock_dir, BLOCK, num_slots=slots), remote_url=url,
                   remote_scope="tiny", **kw)  # type: ignore[arg-type]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


def connected(*stores: BlockStoreClient) -> bool:
    return all(s.stats().remote_connected for s in stores)


def test_a_block_put_on_one_replica_is_loaded_on_another(
        sock_dir: Path, redis: RedisServer) -> None:
    a_cfg, b_cfg = replica(sock_dir, redis.url), replica(sock_dir, redis.url)
    keys, parents = chain(8)
    with OwnerThread(a_cfg), OwnerThread(b_cfg), BlockStoreClient(a_cfg.socket_path) as a, \
            BlockStoreClient(b_cfg.socket_path) as b:
        wait_until(lambda: connected(a, b), "both replicas connected to the store")
        a.put_many(keys, [data(i) for i in range(8)], parent_hashes=parents)
        wait_until(lambda: b.stats().num_remote_blocks == 8, "the second replica's index")
        assert b.contains_many(keys) == [True] * 8  # shared memory misses, the store holds
        out = [np.zeros(BLOCK, np.uint8) for _ in range(8)]
        assert b.get_many(keys, out) == [True] * 8
        assert all((o == data(i)).all() for i, o in enumerate(out))
        stats = b.stats()
        assert (stats.num_remote_reads, stats.num_blocks, stats.num_remote_writes) == (8, 8, 0)
        assert a.stats().num_remote_writes == 8  # promoted blocks are not written again
        assert int(redis_command(redis.port, "DBSIZE")[1:-2]) == 8


def chains(events: list[KVEvent], tier: Tier) -> list[tuple[list[int], int | None]]:
    return [(e.block_hashes, e.parent_hash) for e in events
            if isinstance(e, BlockStored) and e.tier == tier]


def joined(events: list[KVEvent], tier: Tier) -> list[tuple[list[int], int | None]]:
    """The tier's stored chains joined into one where each continues the last: a store's
    notifications may arrive in several batches, each announced as a chain of its own."""
    out: list[tuple[list[int], int | None]] = []
    for hashes, parent in chains(events, tier):
        if out and parent is not None and parent == out[-1][0][-1]:
            out[-1] = (out[-1][0] + hashes, out[-1][1])
        else:
            out.append((list(hashes), parent))
    return out


async def test_blocks_keyed_by_engine_hashes_reach_other_replicas_named(
        sock_dir: Path, redis: RedisServer) -> None:
    """With engine keys, a block put before its name is written through once the engine's
    events name it, its name in the value: the other replica, which never saw those events,
    announces it canonically, and names it in its host tier when it loads it."""
    a_cfg, b_cfg = replica(sock_dir, redis.url), replica(sock_dir, redis.url)
    keys, parents = chain(4)
    canonical = [5000 + i for i in range(4)]
    a_names = BlockNames("a", canonical_keys=False)
    a_events: list[KVEvent] = []
    b_events: list[KVEvent] = []
    async with BlockStoreOwner(a_cfg, a_events.append, a_names) as a, BlockStoreOwner(
            b_cfg, b_events.append, BlockNames("b", canonical_keys=False)) as b:
        assert a.remote is not None and b.remote is not None
        ra, rb = a.remote, b.remote
        await wait_for(lambda: ra.connected and rb.connected, "both tiers connected")
        async with await AsyncBlockStoreClient.connect(a_cfg.socket_path) as client:
            await client.put_many(keys, [data(i) for i in range(4)], parent_hashes=parents)
        await wait_for(lambda: ra.stats().num_unnamed == 4, "the puts held back, unnamed")
        assert ra.stats().num_writes == 0 and not chains(a_events, Tier.HOST)
        a_names.learn([k[1] for k in keys], canonical, None)
        await wait_for(lambda: joined(b_events, Tier.REMOTE) == [(canonical, None)],
                       "the second replica announcing the blocks by their names")
        assert joined(a_events, Tier.HOST) == [(canonical, None)]
        assert joined(a_events, Tier.REMOTE) == [(canonical, None)]
        async with await AsyncBlockStoreClient.connect(b_cfg.socket_path) as client:
            outs = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
            assert await client.get_many(keys, outs) == [True] * 4
        assert all((o == data(i)).all() for i, o in enumerate(outs))
        assert joined(b_events, Tier.HOST) == [(canonical, None)]


def test_blocks_the_store_evicts_leave_every_index(sock_dir: Path, tmp_path: Path) -> None:
    """Under ``maxmemory`` with LRU the store drops blocks on its own: its ``evicted``
    notifications keep both replicas' indexes equal to what it holds."""
    with RedisServer(tmp_path, maxmemory="4mb") as redis:
        a_cfg, b_cfg = replica(sock_dir, redis.url, slots=64), replica(sock_dir, redis.url)
        with OwnerThread(a_cfg), OwnerThread(b_cfg), \
                BlockStoreClient(a_cfg.socket_path) as a, \
                BlockStoreClient(b_cfg.socket_path) as b:
            wait_until(lambda: connected(a, b), "both replicas connected to the store")
            for start in range(0, 48, 8):
                keys, parents = chain(8, start=1000 + start)
                a.put_many(keys, [data(i) for i in range(8)], parent_hashes=parents)
            wait_until(lambda: a.stats().num_remote_writes == 48, "48 blocks written")

            def agree() -> bool:
                held = int(redis_command(redis.port, "DBSIZE")[1:-2])
                return a.stats().num_remote_blocks == b.stats().num_remote_blocks == held < 48

            wait_until(agree, "both indexes to hold what the store kept")


def test_a_corrupt_value_is_a_miss_and_is_deleted(sock_dir: Path, redis: RedisServer) -> None:
    a_cfg, b_cfg = replica(sock_dir, redis.url), replica(sock_dir, redis.url)
    keys, parents = chain(2)
    with OwnerThread(a_cfg), OwnerThread(b_cfg), BlockStoreClient(a_cfg.socket_path) as a, \
            BlockStoreClient(b_cfg.socket_path) as b:
        wait_until(lambda: connected(a, b), "both replicas connected to the store")
        a.put_many(keys, [data(0), data(1)], parent_hashes=parents)
        wait_until(lambda: b.stats().num_remote_blocks == 2, "the second replica's index")
        name = f"kvsidecar:tiny:{BLOCK}:{keys[1][0]:016x}{keys[1][1]:016x}"
        value = bytearray(redis_command(redis.port, "GET", name).split(b"\r\n", 1)[1][:-2])
        value[-1] ^= 0xFF  # the payload's last byte: the header still names the key
        assert redis_command(redis.port, "SET", name, bytes(value)) == b"+OK\r\n"
        out = [np.zeros(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)]
        assert b.get_many(keys, out) == [True, False]
        assert (out[0] == data(0)).all()
        wait_until(lambda: b.stats().num_remote_corrupt == 1 and not b.contains(keys[1])
                   and a.stats().num_remote_blocks == 1, "the corrupt value deleted")


def test_the_store_killed_mid_load_is_a_miss_and_the_tier_comes_back(
        sock_dir: Path, redis: RedisServer) -> None:
    """Gets load 16 blocks at a time, round after round, while the store is killed: each
    get returns byte-exact blocks or misses, none fails; restarted, the tier reconnects."""
    # The second replica's store holds about one round's blocks: each round loads its 16
    # blocks from the remote tier again, evicting the round before's.
    a_cfg, b_cfg = replica(sock_dir, redis.url, slots=96), replica(sock_dir, redis.url, slots=24)
    keys, parents = chain(64)
    with OwnerThread(a_cfg), OwnerThread(b_cfg), BlockStoreClient(a_cfg.socket_path) as a, \
            BlockStoreClient(b_cfg.socket_path) as b:
        wait_until(lambda: connected(a, b), "both replicas connected to the store")
        a.put_many(keys, [data(i) for i in range(64)], parent_hashes=parents)
        wait_until(lambda: b.stats().num_remote_blocks == 64, "the second replica's index")
        rounds: list[list[bool]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load() -> None:
            try:
                i = 0
                while not stop.is_set():
                    group = keys[(i % 4) * 16 : (i % 4 + 1) * 16]
                    out = [np.zeros(BLOCK, np.uint8) for _ in group]
                    got = b.get_many(group, out)
                    for (_, h), ok, block in zip(group, got, out, strict=True):
                        assert not ok or (block == data(h - 100)).all(), "wrong bytes"
                    rounds.append(got)
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            wait_until(lambda: len(rounds) >= 3 or errors, "three rounds loaded")
            redis.kill()
            wait_until(lambda: not b.stats().remote_connected, "the tier to see it gone")
            reads = b.stats().num_remote_reads
            seen = len(rounds)
            wait_until(lambda: len(rounds) >= seen + 4 or errors, "rounds with the store away")
        finally:
            stop.set()
            loader.join()
        assert not errors, errors
        assert all(rounds[i] == [True] * 16 for i in range(3))
        assert reads >= 48  # every round before the kill read the remote tier
        stats = b.stats()
        # The store away: nothing read from it, its blocks misses (the engine computes them;
        # what the host store still holds is still a hit).
        assert stats.num_remote_reads == reads and stats.num_remote_blocks == 0
        assert any(False in r for r in rounds[seen:]) and stats.num_remote_errors >= 1
        redis.start()
        wait_until(lambda: connected(a, b), "both replicas reconnected", timeout_s=30)
        a.put_many([(9, 1)], [data(1)])
        wait_until(lambda: b.stats().num_remote_blocks == 1, "a new block shared again")


def test_write_on_evict_sends_only_what_the_host_store_evicts(
        sock_dir: Path, redis: RedisServer) -> None:
    cfg = replica(sock_dir, redis.url, slots=8, remote_write="evict")
    keys, parents = chain(24)
    with OwnerThread(cfg), BlockStoreClient(cfg.socket_path) as store:
        wait_until(lambda: connected(store), "connected to the store")
        for i in range(0, 24, 4):
            store.put_many(keys[i : i + 4], [data(j) for j in range(i, i + 4)],
                           parent_hashes=parents[i : i + 4])
        stats = store.stats()
        evicted = stats.num_evictions
        assert evicted >= 16
        wait_until(lambda: store.stats().num_remote_writes == evicted, "the evicted written")
        out = np.zeros(BLOCK, np.uint8)
        assert store.get(keys[0], out) is out and (out == data(0)).all()  # back from remote
        assert store.stats().num_remote_reads == 1


def test_a_store_that_is_not_there_costs_nothing_but_counted_drops(
        sock_dir: Path, tmp_path: Path) -> None:
    """A sidecar whose remote store is down at start serves its host tier as before."""
    with RedisServer(tmp_path) as gone:
        url = gone.url
    cfg = replica(sock_dir, url)
    keys, parents = chain(4)
    with OwnerThread(cfg), BlockStoreClient(cfg.socket_path) as store:
        store.put_many(keys, [data(i) for i in range(4)], parent_hashes=parents)
        out = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
        assert store.get_many(keys, out) == [True] * 4
        assert store.get_many([(5, 5)], [np.zeros(BLOCK, np.uint8)]) == [False]
        stats = store.stats()
        assert not stats.remote_connected and stats.num_remote_dropped == 4
        wait_until(lambda: store.stats().num_remote_errors >= 1, "the failed connects counted")
