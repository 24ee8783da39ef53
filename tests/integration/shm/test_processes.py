"""The block store across real processes: owner via ``python -m shm``, clients as workers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.local_store import StoreProcess
from shm import (
    BlockSizeError,
    BlockStoreClient,
    ClientDetachedError,
    StoreFullError,
    segments_of,
)
from shm.segment import Segment
from tests.support.polling import wait_until
from tests.support.processes import read_line

pytestmark = pytest.mark.slow  # real processes, seconds a test

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("_worker.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
DEADLINE_S = 20.0


def content(ns: int, block_hash: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng([ns, block_hash]).integers(0, 256, block_bytes, dtype=np.uint8)


class Processes:
    """Starts owners and workers and makes sure none outlives the test."""

    def __init__(self, sock_dir: Path) -> None:
        self.sock_dir = sock_dir
        self.procs: list[subprocess.Popen[str]] = []
        self.owners: list[StoreProcess] = []

    def owner(self, owner_id: str, *, slots: int, block_bytes: int,
              extra: tuple[str, ...] = ()) -> StoreProcess:
        owner = StoreProcess.start(self.sock_dir, owner_id=owner_id,
                                   socket=self.sock_dir / "store.sock", block_bytes=block_bytes,
                                   capacity_bytes=slots * block_bytes, args=extra,
                                   log_level="info", env=ENV)
        self.owners.append(owner)
        ready = owner.process.ready[0]
        assert ready["event"] == "shm_owner_ready" and ready["pid"] == owner.proc.pid
        return owner

    def worker(self, socket: Path, *args: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(socket), *map(str, args)], cwd=ROOT, env=ENV,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        for owner in reversed(self.owners):  # a SIGKILLed owner's stale segments: unlinked
            owner.stop()


@pytest.fixture
def procs() -> Iterator[Processes]:
    sock_dir = Path(tempfile.mkdtemp(prefix="kvs-"))
    processes = Processes(sock_dir)
    try:
        yield processes
    finally:
        processes.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def owner_id() -> str:
    return f"it{uuid.uuid4().hex[:10]}"


def test_concurrent_writers_and_readers_are_byte_exact(procs: Processes, owner_id: str) -> None:
    """Two writers and two readers in four processes, with eviction: every hit is exact.

    Readers read both namespaces: one reading only its own could find every block of it
    evicted, as LRU should when the other reader keeps its blocks recent.
    """
    owner = procs.owner(owner_id, slots=64, block_bytes=4096)
    readers = [procs.worker(owner.socket, "read", "1,2", 1, 96, 4096) for _ in (1, 2)]
    assert [read_line(r) for r in readers] == ["reading", "reading"]  # before any write
    writers = [procs.worker(owner.socket, "write", ns, 1, 96, 4096) for ns in (1, 2)]
    assert [read_line(w) for w in writers] == ["done", "done"]
    for reader in readers:  # the writes are done: it reads on until a hit
        assert reader.stdin is not None
        reader.stdin.write("done\n")
        reader.stdin.flush()
    results = [read_line(r) for r in readers]
    assert all(r.startswith("hits ") and int(r.split()[1]) > 0 for r in results), results
    assert [p.wait(timeout=DEADLINE_S) for p in writers + readers] == [0, 0, 0, 0]
    with BlockStoreClient(owner.socket) as client:
        stats = client.stats()
        # Every block put is held or was evicted. The writers' slots granted ahead of a next
        # put (16 at most: a quarter of the store) evicted blocks too; they are free now.
        assert stats.num_puts == 192 and stats.num_granted == 0
        assert stats.num_evictions == 192 - stats.num_blocks
        assert 64 - 16 <= stats.num_blocks == 64 - stats.num_free_slots
        keys = [(ns, h) for ns in (1, 2) for h in range(1, 97)]
        outs = [np.empty(4096, np.uint8) for _ in keys]
        hits = [hit for start in range(0, len(keys), 32)
                for hit in client.get_many(keys[start : start + 32], outs[start : start + 32])]
        assert sum(hits) == stats.num_blocks
        for key, hit, out in zip(keys, hits, outs, strict=True):
            assert not hit or out.tobytes() == content(*key, 4096).tobytes()


def test_reader_killed_holding_leases(procs: Processes, owner_id: str) -> None:
    """A reader SIGKILLed while holding leases: the owner releases them, eviction resumes."""
    owner = procs.owner(owner_id, slots=8, block_bytes=4096)
    with BlockStoreClient(owner.socket) as client:
        client.put_many([(1, h) for h in range(8)], [content(1, h, 4096) for h in range(8)])
        reader = procs.worker(owner.socket, "lease", 1, 0, 8)
        assert read_line(reader) == "leased 8"
        assert client.stats().num_leased_blocks == 8
        with pytest.raises(StoreFullError):
            client.put((2, 0), content(2, 0, 4096))
        reader.send_signal(signal.SIGKILL)
        assert reader.wait(timeout=DEADLINE_S) == -signal.SIGKILL
        wait_until(lambda: client.stats().num_leased_blocks == 0, "leases to be released")
        assert client.put((2, 0), content(2, 0, 4096)) is True
        assert client.get((2, 0)).tobytes() == content(2, 0, 4096).tobytes()


def test_writer_killed_mid_write(procs: Processes, owner_id: str) -> None:
    """A writer SIGKILLed mid-write leaves nothing visible and its slots come back."""
    owner = procs.owner(owner_id, slots=8, block_bytes=4096)
    writer = procs.worker(owner.socket, "half-write", 3, 0, 4)
    assert read_line(writer) == "reserved"
    with BlockStoreClient(owner.socket) as client:
        stats = client.stats()  # its reserve also asked for slots ahead: 2, a quarter
        assert (stats.num_reserved, stats.num_granted, stats.num_free_slots) == (4, 2, 2)
        assert client.contains_many([(3, h) for h in range(4)]) == [False] * 4
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=DEADLINE_S)
        wait_until(lambda: client.stats().num_reserved == 0, "reservations to be freed")
        assert (client.stats().num_free_slots, client.stats().num_granted) == (8, 0)
        assert client.contains_many([(3, h) for h in range(4)]) == [False] * 4
        keys = [(3, h) for h in range(4)]
        assert client.put_many(keys, [content(3, h, 4096) for h in range(4)]) == [True] * 4
        for key in keys:
            assert client.get(key).tobytes() == content(*key, 4096).tobytes()


def test_writer_killed_mid_write_into_granted_slots(procs: Processes, owner_id: str) -> None:
    """A writer SIGKILLed while filling slots granted ahead (claimed for its keys) leaves
    nothing visible: its claimed and granted slots come back."""
    owner = procs.owner(owner_id, slots=16, block_bytes=4096)
    writer = procs.worker(owner.socket, "granted-half-write", 3, 0, 4)
    assert read_line(writer) == "claimed"
    with BlockStoreClient(owner.socket) as client:
        wait_until(lambda: client.stats().num_claimed == 4, "the claim to reach the owner")
        stats = client.stats()
        assert (stats.num_reserved, stats.num_granted, stats.num_blocks) == (4, 4, 4), stats
        assert client.contains_many([(3, h) for h in range(4)]) == [False] * 4
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=DEADLINE_S)
        wait_until(lambda: client.stats().num_sessions == 1, "the writer's session to close")
        stats = client.stats()
        assert (stats.num_reserved, stats.num_granted, stats.num_free_slots) == (0, 0, 12)
        assert client.contains_many([(3, h) for h in range(4)]) == [False] * 4
        keys = [(3, h) for h in range(4)]
        assert client.put_many(keys, [content(3, h, 4096) for h in range(4)]) == [True] * 4
        for key in keys:
            assert client.get(key).tobytes() == content(*key, 4096).tobytes()


def test_reads_skip_the_owner_once_a_client_knows_where_blocks_are(
    procs: Processes, owner_id: str
) -> None:
    """A client reads what it put without a round trip; another client leases the first
    time, then reads optimistically too; a client with optimistic reads off always leases.
    The owner counts every hit, optimistic ones included, also after their client left."""
    owner = procs.owner(owner_id, slots=16, block_bytes=4096)
    keys = [(5, h) for h in range(8)]
    outs = [np.empty(4096, np.uint8) for _ in keys]

    def read_all(client: BlockStoreClient) -> None:
        assert client.get_many(keys, outs) == [True] * 8
        assert all(o.tobytes() == content(*k, 4096).tobytes() for k, o in zip(keys, outs,
                                                                              strict=True))

    with BlockStoreClient(owner.socket) as writer:
        assert writer.put_many(keys, [content(*k, 4096) for k in keys]) == [True] * 8
        read_all(writer)
        assert (writer.stats().num_hits, writer.stats().num_optimistic_hits) == (8, 8)
        with BlockStoreClient(owner.socket) as other:
            read_all(other)  # no hints yet: one lease
            read_all(other)  # the lease told it where they are
        assert (writer.stats().num_hits, writer.stats().num_optimistic_hits) == (24, 16)
        with BlockStoreClient(owner.socket, optimistic_reads=False) as leasing:
            read_all(leasing)
            read_all(leasing)
        assert (writer.stats().num_hits, writer.stats().num_optimistic_hits) == (40, 16)


def test_a_bad_block_fails_a_put_and_leaves_nothing_reserved(procs: Processes,
                                                               owner_id: str) -> None:
    """The blocking client checks a put's arrays while the owner handles its request: a
    wrong-sized one fails the put with BlockSizeError and its reservation (or claim) is
    given back, whether the client held a grant or not."""
    owner = procs.owner(owner_id, slots=32, block_bytes=4096)
    with BlockStoreClient(owner.socket) as client:
        for first in (0, 10):  # no grant yet; then slots granted ahead by the first put
            keys = [(4, h) for h in range(first, first + 4)]
            arrays = [content(*k, 4096) for k in keys]
            with pytest.raises(BlockSizeError, match="block 2 is 4095 bytes"):
                client.put_many(keys, [*arrays[:2], np.zeros(4095, np.uint8), arrays[3]])
            stats = client.stats()
            assert (stats.num_reserved, stats.num_blocks) == (0, 4 if first else 0)
            assert client.put_many(keys, arrays) == [True] * 4
            assert client.get(keys[2]).tobytes() == arrays[2].tobytes()
        assert client.stats().num_granted > 0  # the second round took the grant path


def test_hints_stay_bounded_and_keep_the_newest(procs: Processes, owner_id: str) -> None:
    """A writer's hints (where its blocks are) stay within their limit however much it puts,
    and the newest survive a trim: it still reads its last puts without the owner."""
    owner = procs.owner(owner_id, slots=64, block_bytes=4096)
    block = np.zeros(4096, np.uint8)
    with BlockStoreClient(owner.socket) as writer:
        limit = writer._attachment._hint_limit
        for first in range(0, limit + 3 * 64, 64):
            writer.put_many([(3, h) for h in range(first, first + 64)], [block] * 64)
            assert len(writer._attachment._where) <= limit
        last = [(3, h) for h in range(first, first + 64)]
        before = writer.stats().num_optimistic_hits
        assert writer.get_many(last, [np.empty(4096, np.uint8) for _ in last]) == [True] * 64
        assert writer.stats().num_optimistic_hits == before + 64


def test_writer_killed_after_publishing_its_slots(procs: Processes, owner_id: str) -> None:
    """A writer that published its reserved slots in the read index has committed them,
    with no message: another client sees the blocks at once, byte for byte, and they stay
    after the writer is SIGKILLed."""
    owner = procs.owner(owner_id, slots=8, block_bytes=4096)
    writer = procs.worker(owner.socket, "published-put", 6, 0, 4)
    line = read_line(writer)
    assert line.startswith("written ")
    slots = [int(s) for s in line.split()[1:]]
    keys = [(6, h) for h in range(4)]
    with BlockStoreClient(owner.socket) as client:
        assert client.contains_many(keys) == [True] * 4
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=DEADLINE_S)
        wait_until(lambda: client.stats().num_sessions == 1, "the writer's session to close")
        stats = client.stats()
        assert (stats.num_reserved, stats.num_blocks) == (0, 4)
        with client.leased(keys) as views:
            assert [v is not None and bool((v == 0xCD).all()) for v in views] == [True] * 4
        segment = Segment.attach(owner.segment)
        try:
            assert [int(segment.index.seq[s]) % 2 for s in slots] == [0, 0, 0, 0]
        finally:
            segment.close()


def test_a_stopped_owner_fails_a_call_after_the_timeout(procs: Processes,
                                                          owner_id: str) -> None:
    """An owner that stops answering (SIGSTOP) fails a call once the client's ``timeout_s``
    has passed, saying so, whether the client spins for its reply first or not."""
    owner = procs.owner(owner_id, slots=4, block_bytes=4096)
    for spin_us in (200.0, 0.0):
        # (1 s: a running owner's replies, on a loaded machine too, come well within it)
        with BlockStoreClient(owner.socket, timeout_s=1.0, spin_us=spin_us) as client:
            assert client.put((1, 1), content(1, 1, 4096)) in (True, False)
            owner.proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(ClientDetachedError, match="timeout_s"):
                    client.contains((1, 1))
            finally:
                owner.proc.send_signal(signal.SIGCONT)
            with pytest.raises(ClientDetachedError):  # detached: the stream is out of step
                client.contains((1, 1))
    for bad in ({"timeout_s": 0.0}, {"spin_us": -1.0}):
        with pytest.raises(ValueError, match="timeout_s must be > 0"):
            BlockStoreClient(owner.socket, **bad)  # type: ignore[arg-type]


def test_owner_restart_unlinks_stale_segments(procs: Processes, owner_id: str) -> None:
    """A SIGKILLed owner's segment and socket are found and removed by its successor."""
    first = procs.owner(owner_id, slots=4, block_bytes=4096)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=DEADLINE_S)
    assert segments_of(owner_id) == [first.segment]  # left behind by the crash
    assert first.socket.exists()
    second = procs.owner(owner_id, slots=4, block_bytes=4096)
    assert second.segment != first.segment
    assert segments_of(owner_id) == [second.segment]
    with BlockStoreClient(second.socket, expected_owner_id=owner_id) as client:
        assert client.put((1, 1), content(1, 1, 4096)) is True
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=DEADLINE_S) == 0
    assert segments_of(owner_id) == []
    assert not second.socket.exists()


def test_sigterm_with_clients_attached(procs: Processes, owner_id: str) -> None:
    """SIGTERM unlinks everything even with clients holding leases; they get detached."""
    owner = procs.owner(owner_id, slots=4, block_bytes=4096)
    client = BlockStoreClient(owner.socket)
    try:
        client.put((1, 1), content(1, 1, 4096))
        holder = procs.worker(owner.socket, "lease", 1, 1, 1)
        assert read_line(holder) == "leased 1"
        owner.proc.send_signal(signal.SIGTERM)
        assert owner.proc.wait(timeout=DEADLINE_S) == 0
        assert segments_of(owner_id) == []
        with pytest.raises(ClientDetachedError):
            client.contains((1, 1))
    finally:
        client.close()


def test_second_owner_with_same_id_is_refused(procs: Processes, owner_id: str) -> None:
    """Starting an owner whose id is live elsewhere exits 3 and leaves the first intact."""
    first = procs.owner(owner_id, slots=4, block_bytes=4096)
    other_dir = procs.sock_dir / "other"
    other_dir.mkdir()
    second = subprocess.run(
        [sys.executable, "-m", "shm", "--owner-id", owner_id, "--socket",
         str(other_dir / "s.sock"), "--capacity-bytes", "16KiB", "--block-bytes", "4KiB"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert second.returncode == 3 and "live owner" in second.stderr
    assert segments_of(owner_id) == [first.segment]
    with BlockStoreClient(first.socket) as client:
        client.ping()


def test_cli_help_and_bad_flags() -> None:
    """--help describes the owner; a bad size is refused with a clear message."""
    help_out = subprocess.run([sys.executable, "-m", "shm", "--help"], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=DEADLINE_S)
    assert help_out.returncode == 0 and "--capacity-bytes" in help_out.stdout
    via_cli = subprocess.run([sys.executable, "-m", "kvsidecar", "shm", "--help"], cwd=ROOT,
                             env=ENV, capture_output=True, text=True, timeout=DEADLINE_S)
    assert via_cli.returncode == 0 and via_cli.stdout.startswith("usage: kvsidecar shm")
    bad = subprocess.run(
        [sys.executable, "-m", "shm", "--owner-id", "x", "--socket", "/tmp/x.sock",
         "--capacity-bytes", "1KiB", "--block-bytes", "4KiB"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert bad.returncode == 2 and "holds no block of 4096 bytes" in bad.stderr


def test_put_is_visible_to_requests_queued_behind_other_frames(
    procs: Processes, owner_id: str
) -> None:
    """A block whose put returned is seen by a later request on another socket, always."""
    from shm.protocol import Publish, Reserve, Slots

    owner = procs.owner(owner_id, slots=8, block_bytes=4096, extra=("--sched-batch",))
    # One CPU for the test and a SCHED_BATCH owner: the owner then runs only when a client
    # blocks, and sees the reader's Release (sent first), the writer's Publish
    # and the reader's Contains in one wake-up, with the reader's socket ready first.
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(owner.proc.pid, {cpu})
    os.sched_setaffinity(0, {cpu})
    try:
        with BlockStoreClient(owner.socket) as writer, BlockStoreClient(owner.socket) as reader:
            reader.put((1, 0), content(1, 0, 4096))
            out = np.empty(4096, np.uint8)
            for i in range(1, 51):
                # put_many's frames, split so the reader can act between them.
                reply = writer._call(Reserve([1], [i]), Slots)
                slots, gens = writer._attachment.write_blocks(reply, [content(1, i, 4096)])
                assert reader.get_many([(1, 0)], [out]) == [True]  # leaves a Release queued
                writer._send_only(Publish(slots, gens))  # put_many returns here
                assert reader.contains((1, i)), f"put {i} was not visible after it returned"
                assert reader.get((1, i)).tobytes() == content(1, i, 4096).tobytes()
    finally:
        os.sched_setaffinity(0, before)


def test_published_blocks_survive_the_writer_exiting(procs: Processes, owner_id: str) -> None:
    """A writer that exits right after put_many returns leaves its blocks stored."""
    owner = procs.owner(owner_id, slots=8, block_bytes=4096)
    keys = [(2, i) for i in range(4)]
    with BlockStoreClient(owner.socket) as writer:
        assert writer.put_many(keys, [content(2, i, 4096) for i in range(4)]) == [True] * 4
    with BlockStoreClient(owner.socket) as reader:
        assert reader.contains_many(keys) == [True] * 4
        assert reader.stats().num_reserved == 0
