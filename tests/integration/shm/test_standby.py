"""Standby grants across real processes (``shm.owner.store.standby``): a writer overwrites the
least recently used blocks sending no message at all, the owner picks its put up from the
read index (before any request, on its poll, at the writer's end), and takes a grant back,
through the shared compare-and-swap word, when another client needs those blocks."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shm import BlockStoreClient, StoreFullError
from tests.integration.shm.test_processes import DEADLINE_S, Processes, content
from tests.support.polling import wait_until
from tests.support.processes import read_line

pytestmark = pytest.mark.slow  # real processes, seconds a test

BLOCK = 4096


@pytest.fixture
def procs() -> Iterator[Processes]:
    sock_dir = Path(tempfile.mkdtemp(prefix="kvs-"))
    processes = Processes(sock_dir)
    try:
        yield processes
    finally:
        processes.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _id() -> str:
    return f"sb{uuid.uuid4().hex[:10]}"


def _put(client: BlockStoreClient, ns: int, hashes: range) -> list[bool]:
    return client.put_many([(ns, h) for h in hashes], [content(ns, h, BLOCK) for h in hashes])


def _exact(client: BlockStoreClient, ns: int, hashes: range) -> list[bool]:
    """Per key, a hit; raises on a torn block."""
    keys = [(ns, h) for h in hashes]
    outs = [np.empty(BLOCK, np.uint8) for _ in keys]
    hits = client.get_many(keys, outs)
    for hit, out, h in zip(hits, outs, hashes, strict=True):
        assert not hit or np.array_equal(out, content(ns, h, BLOCK)), f"block {ns}/{h} torn"
    return hits


def test_an_idle_writers_grant_is_taken_back_for_another_reserve(procs: Processes) -> None:
    """A writer holds the whole of a full store's older half on standby; another client
    puts as much as the store holds: no StoreFullError, every block byte-exact, and the
    writer's next put finds its grant gone and reserves instead."""
    owner = procs.owner(_id(), slots=128, block_bytes=BLOCK, extra=("--grant-fraction", "0"))
    writer = procs.worker(owner.socket, "standby", 1, 1, 64, BLOCK, 3)
    # Batch 2 filled the store, so batch 3 overwrote batch 1 over a grant, and once the
    # owner picked that up it put batch 2 on standby.
    assert read_line(writer) == "holding 64 hits 192"
    with BlockStoreClient(owner.socket) as client:
        stats = client.stats()
        assert (stats.num_standby, stats.num_overwrites) == (64, 64)
        assert _exact(client, 1, range(65, 129)) == [True] * 64  # standby: still readable
        assert _put(client, 2, range(1, 129)) == [True] * 128
        assert _exact(client, 2, range(1, 129)) == [True] * 128
        stats = client.stats()  # on standby now: our own blocks, for our next put
        assert (stats.num_standby, stats.num_blocks, stats.num_overwrites) == (128, 128, 64)
        assert not any(_exact(client, 1, range(1, 193)))  # evicted, not torn
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert read_line(writer) == "put 64"  # reserved: it took our grant back
        assert writer.wait(timeout=DEADLINE_S) == 0
        assert client.stats().num_overwrites == 64
        assert sum(_exact(client, 2, range(1, 129))) == 64  # the writer's put evicted 64


def test_a_grant_taken_mid_copy_is_in_flight_until_its_writer_goes(procs: Processes) -> None:
    """A writer takes its grant and stalls mid-put: the owner cannot take it back, so its
    blocks are gone (readers miss, never see a torn block) and its slots are in flight:
    a reserve that needs them fails as against any put in flight, until the writer dies."""
    owner = procs.owner(_id(), slots=128, block_bytes=BLOCK, extra=("--grant-fraction", "0"))
    writer = procs.worker(owner.socket, "standby", 1, 1, 64, BLOCK, 3, "take")
    assert read_line(writer) == "holding 64 hits 192 taken"
    with BlockStoreClient(owner.socket) as client:
        with pytest.raises(StoreFullError):
            _put(client, 2, range(1, 129))
        assert not any(_exact(client, 1, range(65, 129)))  # batch 2: being overwritten
        assert _exact(client, 1, range(129, 193)) == [True] * 64
        assert _put(client, 2, range(1, 65)) == [True] * 64  # evicts batch 3
        writer.kill()
        writer.wait(timeout=DEADLINE_S)
        # Its slots go with its session, and our grant is taken back: free slots come first.
        wait_until(lambda: client.stats().num_free_slots == 64, "the writer's slots freed")
        assert client.stats().num_standby == 0
        assert _put(client, 2, range(65, 129)) == [True] * 64
        assert _exact(client, 2, range(1, 129)) == [True] * 128


def test_writers_racing_over_standby_grants_stay_byte_exact(procs: Processes) -> None:
    """Two writers overwrite standby grants and take each other's back while a reader
    reads both: every hit byte-exact, no StoreFullError, every block put held or evicted.

    Whether a racing put finds its grant still offered is the machine's timing, so each
    writer first puts over a grant alone (no other client puts to take it back), and
    only then do both race. No write-ahead grants: a writer holding one is offered none."""
    owner = procs.owner(_id(), slots=192, block_bytes=BLOCK, extra=("--grant-fraction", "0"))
    writers = []
    for ns in (1, 2):
        writer = procs.worker(owner.socket, "standby", ns, 1, 64, BLOCK, 40, "race")
        assert read_line(writer) == "overwrote"
        writers.append(writer)
    reader = procs.worker(owner.socket, "read", "1,2", 2497, 64, BLOCK)
    assert read_line(reader) == "reading"
    for writer in writers:  # the race
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
    results = [read_line(w) for w in writers]
    assert all(r.startswith("raced ") for r in results), results
    assert reader.stdin is not None
    reader.stdin.write("done\n")  # it read while they raced: now on until a hit
    reader.stdin.flush()
    assert read_line(reader).startswith("hits ")
    assert [p.wait(timeout=DEADLINE_S) for p in [*writers, reader]] == [0, 0, 0]
    with BlockStoreClient(owner.socket) as client:
        stats = client.stats()
        assert stats.num_puts == 2 * 40 * 64 and stats.num_overwrites >= 2 * 64
        assert stats.num_evictions == stats.num_puts - stats.num_blocks
        assert stats.num_standby == 0 and stats.num_reserved == 0
        assert stats.num_blocks + stats.num_free_slots == 192
        for ns in (1, 2):
            _exact(client, ns, range(1, 40 * 64 + 1))


def test_a_silent_put_is_picked_up_on_the_owners_poll(procs: Processes) -> None:
    """A put over a grant sends nothing, and no other client asks anything: the owner
    picks it up on its own poll (it offers the writer its next grant), and the blocks
    are there, byte-exact."""
    owner = procs.owner(_id(), slots=128, block_bytes=BLOCK, extra=("--grant-fraction", "0"))
    writer = procs.worker(owner.socket, "standby", 1, 1, 64, BLOCK, 3, "silent")
    assert read_line(writer) == "holding 64 hits 192"
    assert writer.stdin is not None
    writer.stdin.write("go\n")
    writer.stdin.flush()
    assert read_line(writer) == "put"
    writer.stdin.write("go\n")
    writer.stdin.flush()
    assert read_line(writer) == "picked up"  # the writer polled its word; nobody asked
    with BlockStoreClient(owner.socket) as client:
        assert client.stats().num_overwrites == 128
        assert _exact(client, 1, range(129, 257)) == [True] * 128


def test_a_silent_put_is_visible_to_the_next_request_and_outlives_its_writer(
        procs: Processes) -> None:
    """The owner is stopped while a writer puts over its grant, and the writer is killed
    before the owner runs again: the put it returned from is committed all the same,
    and another client's first request sees it (the owner picks a recorded put up
    before any request, and at its writer's end), byte-exact."""
    owner = procs.owner(_id(), slots=128, block_bytes=BLOCK, extra=("--grant-fraction", "0"))
    writer = procs.worker(owner.socket, "standby", 1, 1, 64, BLOCK, 3, "silent")
    assert read_line(writer) == "holding 64 hits 192"
    with BlockStoreClient(owner.socket) as client:
        os.kill(owner.proc.pid, signal.SIGSTOP)
        try:
            assert writer.stdin is not None
            writer.stdin.write("go\n")
            writer.stdin.flush()
            assert read_line(writer) == "put"  # no owner ran: nothing was sent
            writer.kill()
            writer.wait(timeout=DEADLINE_S)
        finally:
            os.kill(owner.proc.pid, signal.SIGCONT)
        assert client.contains_many([(1, h) for h in range(193, 257)]) == [True] * 64
        assert _exact(client, 1, range(129, 257)) == [True] * 128
        wait_until(lambda: client.stats().num_standby == 0, "the dead writer's grant gone")
        assert client.stats().num_overwrites == 128
