"""An importer that starts a pull and then stalls until it is killed (a test helper).

    python _stalled_importer.py tcp  <exporter_url> <ns> <count> <block_bytes>
    python _stalled_importer.py shm  <store_socket> <ns> <count>

tcp: asks the exporter for a TCP export over HTTP, opens the block stream and reads one
block of it, then stops reading. shm: leases the blocks through the exporter's store
socket with the same lease-only reader a real shm pull uses, and keeps them. Either way it
prints ``stalled`` once it holds the exporter's leases, then sleeps.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import urllib.request
import uuid

from shm.client.reader import AsyncSegmentReader


def tcp(url: str, ns: int, count: int, block_bytes: int) -> None:
    body = json.dumps(
        {
            "keys": [[ns, i] for i in range(count)],
            "transport": "tcp",
            "block_bytes": block_bytes,
            "dtype": "uint8",
            "ttl_s": 60,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/blocks/export", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        offer = json.loads(resp.read())
    sock = socket.create_connection((offer["tcp_host"], offer["tcp_port"]))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.sendall(b"KVX1" + uuid.UUID(hex=offer["export_id"]).bytes)
    got = 0
    while got < 1 + block_bytes:
        got += len(sock.recv(1 + block_bytes - got))
    print("stalled", flush=True)
    time.sleep(600)


async def shm(path: str, ns: int, count: int) -> None:
    reader = await AsyncSegmentReader.connect(path)
    reply = await reader.lease([(ns, i) for i in range(count)])
    assert None not in reply.slots
    print("stalled", flush=True)
    await asyncio.sleep(600)


if __name__ == "__main__":
    mode, target, ns_text, count_text = sys.argv[1:5]
    if mode == "tcp":
        tcp(target, int(ns_text), int(count_text), int(sys.argv[5]))
    else:
        asyncio.run(shm(target, int(ns_text), int(count_text)))
