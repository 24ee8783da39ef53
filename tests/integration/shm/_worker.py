"""A block store client run as its own process by the integration tests.

    python _worker.py SOCKET write NS FIRST COUNT BLOCK_BYTES   put in batches of 8, print "done"
    python _worker.py SOCKET read NS[,NS...] FIRST COUNT BLOCK_BYTES
        read the range (of each namespace) repeatedly in batches of 8, checking every hit
        byte-exact; print "reading" after the first round, go on until a line of stdin,
        then until a hit, and print "hits N"
    python _worker.py SOCKET lease NS FIRST COUNT               lease, print "leased", hang
    python _worker.py SOCKET half-write NS FIRST COUNT          reserve, fill half, print
                                                                "reserved", hang
    python _worker.py SOCKET granted-half-write NS FIRST COUNT
        put COUNT other blocks (which gets slots granted ahead), then fill half the granted
        slots for the range, claimed for it, print "claimed", hang
    python _worker.py SOCKET published-put NS FIRST COUNT       reserve, write 0xCD and publish
        in the read index as put_many does (its commit), send nothing more; print
        "written SLOTS", hang
    python _worker.py SOCKET standby NS FIRST COUNT BLOCK_BYTES ROUNDS [take|race|silent]
        put ROUNDS batches of COUNT (into a full store, over standby grants), reading each
        back (a torn block: print "mismatch", exit 1). race: put until the store is full,
        wait for the owner's grant and put the next batch over it (none taken: print "no
        grant taken", exit 1), print "overwrote"; then on a line of stdin put the other
        rounds as fast as they go, print "raced HITS", exit. Else print "holding N hits
        HITS" (N: the standby grant held now), then on a line of stdin put one more batch,
        read it back and print "put HITS"; or (take) first take the grant as a put does,
        print "holding N hits HITS taken" and hang; or (silent) on that line put the batch
        over the grant, print "put", and on another line wait (sending nothing) until the
        owner offers the next grant, print "picked up", hang

Block contents are a pure function of the key, so any process can check any block.
"""

from __future__ import annotations

import logging
import select
import sys
import time
from pathlib import Path

import numpy as np
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from shm import BlockStoreClient


def content(ns: int, block_hash: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng([ns, block_hash]).integers(0, 256, block_bytes, dtype=np.uint8)


def main(argv: list[str]) -> int:
    structlog.configure(  # stdout carries our protocol with the test; logs go to stderr
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    sock, command, first, count = argv[0], argv[1], int(argv[3]), int(argv[4])
    namespaces = [int(n) for n in argv[2].split(",")]
    ns = namespaces[0]
    keys = [(n, h) for n in namespaces for h in range(first, first + count)]
    with BlockStoreClient(sock) as client:
        if command == "write":
            block_bytes = int(argv[5])
            for start in range(0, count, 8):
                batch = keys[start : start + 8]
                client.put_many(batch, [content(ns, h, block_bytes) for _, h in batch],
                                parent_hashes=[h - 1 for _, h in batch])
            print("done", flush=True)
        elif command == "read":
            block_bytes = int(argv[5])
            outs = [np.empty(block_bytes, np.uint8) for _ in keys]
            # As long as the test's writers run (it says when they are done, so no count
            # of rounds has to outlast them), then until a hit.
            hits = done = 0
            told = False
            while not (told and hits):
                if done == 1:
                    print("reading", flush=True)
                told = told or bool(select.select([sys.stdin], [], [], 0)[0])
                done += 1
                for start in range(0, len(keys), 8):  # at most 8 leases held at a time
                    batch, batch_outs = keys[start : start + 8], outs[start : start + 8]
                    for got, (n, h), out in zip(client.get_many(batch, batch_outs), batch,
                                                batch_outs, strict=True):
                        if got:
                            hits += 1
                            if not np.array_equal(out, content(n, h, block_bytes)):
                                print(f"mismatch {n} {h}", flush=True)
                                return 1
            print(f"hits {hits}", flush=True)
        elif command == "lease":
            with client.leased(keys) as views:
                print("leased", sum(v is not None for v in views), flush=True)
                sys.stdin.read()  # hang until killed
        elif command in ("half-write", "granted-half-write"):
            if command == "granted-half-write":  # this put gets slots granted ahead
                others = [(n, h + count) for n, h in keys]
                client.put_many(others, [np.zeros(client.block_bytes, np.uint8) for _ in others])
            pending = client.begin_put(keys)  # granted: views at once, a claim on its way
            for view in pending.views[: count // 2]:
                if view is not None:
                    view[:] = 0xAB
            print("claimed" if command == "granted-half-write" else "reserved", flush=True)
            sys.stdin.read()  # hang until killed
        elif command == "published-put":
            from shm.protocol import Reserve, Slots

            reply = client._call(Reserve([n for n, _ in keys], [h for _, h in keys]), Slots)
            arrays = [np.full(client.block_bytes, 0xCD, np.uint8) for _ in keys]
            slots, _ = client._attachment.write_blocks(reply, arrays)
            client._attachment.commit_filled(keys, reply)  # publishes: that commits
            print("written", *slots, flush=True)
            sys.stdin.read()  # hang until killed
        elif command == "standby":
            return _standby(client, ns, first, count, int(argv[5]), int(argv[6]), argv[7:])
        else:
            print(f"unknown command {command}", file=sys.stderr)
            return 2
    return 0


def _standby(client: BlockStoreClient, ns: int, first: int, count: int, block_bytes: int,
             rounds: int, rest: list[str]) -> int:
    def batch(start: int) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
        keys = [(ns, h) for h in range(start, start + count)]
        return keys, [content(ns, h, block_bytes) for _, h in keys]

    def put_and_check(start: int) -> int:
        keys, arrays = batch(start)
        assert all(client.put_many(keys, arrays))
        return read_back(keys)

    def put_over_grant(start: int) -> list[tuple[int, int]]:
        """Put a batch over our standby grant, as ``put_many`` first tries to (sending
        nothing); exits if it took none, where ``put_many`` would have reserved."""
        keys, arrays = batch(start)
        if client._put_standby(keys, arrays, None) is None:
            print("no grant taken", flush=True)
            sys.exit(1)
        return keys

    def read_back(keys: list[tuple[int, int]]) -> int:
        """Read a batch back: how many blocks were there (another writer may have evicted
        some); exits on a torn one."""
        outs = [np.empty(block_bytes, np.uint8) for _ in keys]
        hits = client.get_many(keys, outs)
        if any(hit and not np.array_equal(out, content(ns, h, block_bytes))
               for hit, out, (_, h) in zip(hits, outs, keys, strict=True)):
            print("mismatch", flush=True)
            sys.exit(1)
        return sum(hits)

    attachment = client._attachment
    index, cell = attachment._index, attachment.welcome.hit_cell
    assert index is not None

    def wait_offer(after: int = 0) -> tuple[int, int]:
        """Poll our standby word (sending nothing) until the owner offers a grant of at
        least ``count`` slots with an epoch past ``after``: (epoch, size)."""
        deadline = time.monotonic() + 20
        while (offer := index.offered(cell, count))[0] <= after:
            if time.monotonic() > deadline:
                print("no offer", flush=True)
                sys.exit(1)
            time.sleep(0.001)
        return offer

    hits = 0
    if rest == ["race"]:
        # Until the store is full every put reserves; then the owner offers us a grant, and
        # while no other client puts (the test starts the writers one at a time) nothing
        # takes it back: an overwrite is certain before the race, whatever its timing.
        fill = -(-client.num_slots // count)
        for r in range(fill):
            hits += put_and_check(first + r * count)
        wait_offer()
        hits += read_back(put_over_grant(first + fill * count))
        print("overwrote", flush=True)
        sys.stdin.readline()
        for r in range(fill + 1, rounds):
            hits += put_and_check(first + r * count)
        print("raced", hits, flush=True)
        return 0
    for r in range(rounds):  # the store is full after two batches: wait for each grant
        if r >= 2:
            wait_offer()
        hits += put_and_check(first + r * count)
    epoch, size = wait_offer()
    held = f"holding {size} hits {hits}"
    if rest == ["take"]:  # as a put takes it before its copy; then stall mid-copy
        grant = attachment.take_standby(count)
        assert grant is not None and grant[0] == epoch
        attachment.retract(grant[1])
        print(held, "taken", flush=True)
        sys.stdin.read()  # hang until killed
        return 0
    print(held, flush=True)
    sys.stdin.readline()
    start = first + rounds * count
    if rest == ["silent"]:  # one put over the grant, then wait for the owner's pickup
        put_over_grant(start)  # (the owner may pick it up at once: its word moves on)
        print("put", flush=True)
        sys.stdin.readline()  # one line at a time: the test's read sees no second one
        wait_offer(epoch)  # its next grant: the owner picked the put up, asked nothing
        print("picked up", flush=True)
        sys.stdin.read()  # hang until killed
        return 0
    print("put", put_and_check(start), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
