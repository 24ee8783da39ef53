"""Pulls between two in-process peers: exact bytes, all-or-nothing, specific errors."""

from __future__ import annotations

import socket

import aiohttp
import numpy as np
import pytest

from kvcore.events import BlockStored
from sidecar.transfer import (
    BadTransferRequestError,
    BlockFormatMismatchError,
    NoRoomError,
    PeerUnavailableError,
    Transport,
    UnknownBlocksError,
)
from tests.support.polling import eventually
from tests.support.transfer_peers import (
    Peer,
    PeerFactory,
    assert_untouched,
    content,
    transports,
)

KEYS = [(7, i) for i in range(8)]
LOCAL = [Transport.SHM, Transport.TCP]


async def wait_no_leases(peer: Peer) -> None:
    """The exporter's leases are all given back (the importer releases in the background)."""
    await eventually(
        lambda: not (peer.owner.stats().num_leased_blocks
                     or peer.service.stats().num_exports_open),
        "the exporter to give back its leases", timeout_s=10, interval_s=0.005,
    )


@pytest.mark.parametrize("transport", LOCAL)
async def test_pull_copies_exact_bytes(make_peer: PeerFactory, transport: Transport) -> None:
    """Every pulled block holds the exporter's bytes, and the exporter's leases are gone."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS)
    result = await importer.service.pull(exporter.url, KEYS, transport=transport)
    assert result.imported == tuple(KEYS)
    assert result.already_held == ()
    assert result.num_bytes == len(KEYS) * exporter.owner.config.block_bytes
    for key in KEYS:
        got = importer.read(key)
        assert got is not None
        np.testing.assert_array_equal(got, content(key))
    await wait_no_leases(exporter)
    assert importer.service.stats().by_transport[transport].num_blocks == len(KEYS)


async def test_pull_skips_blocks_already_held(make_peer: PeerFactory) -> None:
    """Keys the importer holds are reported as already held and not fetched again."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS)
    importer.put(KEYS[:3])
    result = await importer.service.pull(exporter.url, KEYS, transport=Transport.SHM)
    assert result.already_held == tuple(KEYS[:3])
    assert result.imported == tuple(KEYS[3:])
    again = await importer.service.pull(exporter.url, KEYS, transport=Transport.SHM)
    assert again.imported == () and again.already_held == tuple(KEYS)
    assert exporter.owner.stats().num_hits == len(KEYS) - 3  # leased once, only the rest


async def test_imported_blocks_are_reported_as_host_tier_events(make_peer: PeerFactory) -> None:
    """The importer's store announces the imported blocks, with the parents passed in."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS[:2])
    await importer.service.pull(exporter.url, KEYS[:2], transport=Transport.TCP,
                                parent_hashes=[None, KEYS[0][1]])
    stored = [e for e in importer.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [k[1] for k in KEYS[:2]]


@pytest.mark.parametrize("transport", LOCAL)
async def test_unknown_keys_fail_the_whole_pull(make_peer: PeerFactory,
                                                transport: Transport) -> None:
    """A key the exporter lacks fails the pull, names the key, and imports nothing."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS[:4])
    with pytest.raises(UnknownBlocksError) as info:
        await importer.service.pull(exporter.url, KEYS, transport=transport)
    assert info.value.missing == KEYS[4:]
    assert_untouched(importer)
    await wait_no_leases(exporter)
    assert importer.service.stats().by_transport[transport].num_failed == 1


async def test_block_size_mismatch_is_refused(make_peer: PeerFactory) -> None:
    """Stores with different block sizes cannot trade blocks."""
    exporter = await make_peer(block_bytes=32 << 10)
    importer = await make_peer()
    with pytest.raises(BlockFormatMismatchError, match="32768-byte"):
        await importer.service.pull(exporter.url, KEYS, transport=Transport.SHM)
    assert_untouched(importer)


@pytest.mark.parametrize("transport", transports([*LOCAL, Transport.NIXL]))
async def test_dead_peer_is_peer_unavailable(make_peer: PeerFactory,
                                             transport: Transport) -> None:
    """A peer that does not answer fails the pull fast with PeerUnavailableError."""
    if transport is Transport.NIXL:
        pytest.importorskip("nixl_cu12")
    importer = await make_peer()
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(PeerUnavailableError):
        await importer.service.pull(dead, KEYS, transport=transport, timeout_s=5)
    assert_untouched(importer)


async def test_no_room_fails_before_asking_the_peer(make_peer: PeerFactory) -> None:
    """An importer that cannot reserve slots says so and leaves the exporter alone."""
    exporter, importer = await make_peer(), await make_peer(num_slots=4)
    exporter.put(KEYS)
    with pytest.raises(NoRoomError):
        await importer.service.pull(exporter.url, KEYS, transport=Transport.TCP)
    assert exporter.service.stats().num_exports_opened == 0
    assert_untouched(importer)


@pytest.mark.parametrize(("keys", "transport"), [
    ([], Transport.SHM),
    ([(1, 2, 3)], Transport.SHM),
    ([(-1, 2)], Transport.SHM),
    ([(1, 1 << 64)], Transport.SHM),
    ([(1, 2)], "pigeon"),
])
async def test_bad_pull_arguments_are_bad_requests(make_peer: PeerFactory, keys: list,
                                                   transport: str) -> None:
    """Empty or malformed keys and unknown transports are refused before anything happens."""
    importer = await make_peer()
    with pytest.raises(BadTransferRequestError):
        await importer.service.pull("http://127.0.0.1:1", keys, transport=transport)


async def test_nixl_disabled_exporter_says_transport_unavailable(make_peer: PeerFactory) -> None:
    """An exporter without NIXL answers 501 transport_unavailable, naming the reason."""
    exporter = await make_peer(enable_nixl=False)
    exporter.put(KEYS)
    async with aiohttp.ClientSession() as http, http.get(f"{exporter.url}/v1/blocks/nixl") as r:
        body = await r.json()
    assert r.status == 501
    assert body["error"]["code"] == "transport_unavailable"


async def test_http_errors_are_specific(make_peer: PeerFactory) -> None:
    """Bad JSON and shm over HTTP are 400s, an unknown export's release a 410; info works."""
    exporter = await make_peer()
    exporter.put(KEYS)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{exporter.url}/v1/blocks/export", data=b"{nope") as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "bad_request"
        shm_body = {"keys": [[1, 2]], "transport": "shm", "dtype": "uint8", "ttl_s": 1,
                    "block_bytes": exporter.owner.config.block_bytes}
        async with http.post(f"{exporter.url}/v1/blocks/export", json=shm_body) as r:
            assert r.status == 400
            assert "socket" in (await r.json())["error"]["message"]
        async with http.post(f"{exporter.url}/v1/blocks/exports/abc/release") as r:
            assert r.status == 410
            assert (await r.json())["error"]["code"] == "export_gone"
        async with http.get(f"{exporter.url}/v1/blocks/info") as r:
            info = await r.json()
    assert info["block_bytes"] == exporter.owner.config.block_bytes
    assert "shm" in info["transports"] and "tcp" in info["transports"]
    assert info["socket"] == str(exporter.owner.config.socket_path)


async def test_an_unreleased_export_lapses_and_frees_its_leases(make_peer: PeerFactory) -> None:
    """An importer that never confirms loses its export after the TTL; its leases go."""
    exporter = await make_peer(lease_ttl_s=0.3)
    exporter.put(KEYS)
    body = {"keys": [list(k) for k in KEYS], "transport": "tcp",
            "block_bytes": exporter.owner.config.block_bytes, "dtype": "uint8", "ttl_s": 60}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{exporter.url}/v1/blocks/export", json=body) as r:
            offer = await r.json()
        assert exporter.owner.stats().num_leased_blocks == len(KEYS)
        await eventually(lambda: not exporter.owner.stats().num_leased_blocks,
                         "the lapsed export to free its leases", timeout_s=10, interval_s=0.05)
        url = f"{exporter.url}/v1/blocks/exports/{offer['export_id']}/release"
        async with http.post(url) as r:
            assert r.status == 410
    assert exporter.service.stats().num_exports_expired == 1


async def test_pull_route_answers_results_and_specific_errors(make_peer: PeerFactory) -> None:
    """POST /v1/blocks/pull imports, or answers 400 for bad bodies and 404 naming lost keys."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS[:2])
    url = f"{importer.url}/v1/blocks/pull"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=b'{"peer_url": 1}') as r:
            assert r.status == 400
        body = {"peer_url": exporter.url, "keys": [list(k) for k in KEYS[:3]]}
        async with http.post(url, json=body) as r:
            assert r.status == 404
            assert (await r.json())["error"]["missing"] == [list(KEYS[2])]
        body["keys"] = body["keys"][:2]
        async with http.post(url, json={**body, "transport": "tcp"}) as r:
            assert r.status == 200
            assert (await r.json())["imported"] == [list(k) for k in KEYS[:2]]
    np.testing.assert_array_equal(importer.read(KEYS[1]), content(KEYS[1]))
