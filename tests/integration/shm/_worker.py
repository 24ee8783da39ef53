"""A block store client run as its own process by the integration tests.

    python _worker.py SOCKET write NS FIRST COUNT BLOCK_BYTES   put in batches of 8, print "done"
    python _worker.py SOCKET read NS[,NS...] FIRST COUNT BLOCK_BYTES ROUNDS
        read the range (of each namespace) repeatedly in batches of 8, check every hit
        byte-exact, print "hits N"
    python _worker.py SOCKET lease NS FIRST COUNT               lease, print "leased", hang
    python _worker.py SOCKET half-write NS FIRST COUNT          reserve, fill half, print
                                                                "reserved", hang
    python _worker.py SOCKET granted-half-write NS FIRST COUNT
        put COUNT other blocks (which gets slots granted ahead), then fill half the granted
        slots for the range, claimed for it, print "claimed", hang
    python _worker.py SOCKET published-put NS FIRST COUNT       reserve, write 0xCD and publish
        in the read index as put_many does (its commit), send nothing more; print
        "written SLOTS", hang

Block contents are a pure function of the key, so any process can check any block.
"""

from __future__ import annotations

import logging
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
            block_bytes, rounds = int(argv[5]), int(argv[6])
            outs = [np.empty(block_bytes, np.uint8) for _ in keys]
            hits = 0  # keep going past ROUNDS until a hit (the writer may start late)
            deadline = time.monotonic() + 15
            done = 0
            while done < rounds or (hits == 0 and time.monotonic() < deadline):
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
        else:
            print(f"unknown command {command}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
