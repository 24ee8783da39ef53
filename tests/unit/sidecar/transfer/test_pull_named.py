"""Pulling a prefix named by its canonical hashes (a moved prefix, ``sidecar.kv_move``)."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from kvcore.requests import PrefixSource
from shm.block_names import BlockNames
from sidecar.kv_move import PrefixPuller
from sidecar.transfer import Transport, UnknownBlocksError
from tests.support.transfer_peers import PeerFactory, assert_untouched, content

SEED = 7
KEYS = [(SEED, 100 + i) for i in range(8)]


async def test_the_held_leading_blocks_are_pulled(make_peer: PeerFactory) -> None:
    """The exporter holds the first 5 of 8 blocks: those 5 come over, exactly."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put(KEYS[:5])
    result = await importer.service.pull_named(exporter.url, [k[1] for k in KEYS],
                                               transport=Transport.TCP)
    assert result.imported == tuple(KEYS[:5])
    for key in KEYS[:5]:
        np.testing.assert_array_equal(importer.read(key), content(key))


async def test_a_gap_ends_the_prefix(make_peer: PeerFactory) -> None:
    """Block 2 missing: only blocks 0 and 1 are a prefix the importer can use."""
    exporter, importer = await make_peer(), await make_peer()
    exporter.put([KEYS[0], KEYS[1], *KEYS[3:]])
    result = await importer.service.pull_named(exporter.url, [k[1] for k in KEYS])
    assert result.imported == tuple(KEYS[:2])


async def test_store_keys_of_engine_hashes_are_found_by_their_names(
        make_peer: PeerFactory) -> None:
    """A store keyed by the engine's hashes (SGLang's pages) is asked by canonical name;
    the blocks come over under the engine's keys, where the importer's engine looks."""
    names = BlockNames("exporter", canonical_keys=False)
    canonical = [900 + i for i in range(4)]
    names.learn([k[1] for k in KEYS[:4]], canonical, None)
    exporter, importer = await make_peer(names=names), await make_peer()
    exporter.put(KEYS[:4])
    result = await importer.service.pull_named(exporter.url, canonical)
    assert result.imported == tuple(KEYS[:4])
    with pytest.raises(UnknownBlocksError):  # its store hashes are no canonical names
        await importer.service.pull_named(exporter.url, [k[1] for k in KEYS[:4]])


async def test_nothing_held_is_unknown_blocks(make_peer: PeerFactory) -> None:
    """The exporter holds none of the prefix: UnknownBlocksError, nothing imported."""
    exporter, importer = await make_peer(), await make_peer()
    with pytest.raises(UnknownBlocksError, match="none of the prefix"):
        await importer.service.pull_named(exporter.url, [k[1] for k in KEYS])
    assert_untouched(importer)


class TestPrefixPuller:
    async def test_a_pull_reports_what_it_moved(self, make_peer: PeerFactory) -> None:
        """The outcome, and the header the gateway learns from, say blocks and bytes."""
        exporter, importer = await make_peer(), await make_peer()
        exporter.put(KEYS)
        seen = []
        puller = PrefixPuller(importer.service, on_outcome=seen.append)
        outcome = await puller.pull(PrefixSource(exporter.url, [k[1] for k in KEYS]), "r1")
        assert (outcome.error, outcome.blocks) == (None, 8)
        assert outcome.num_bytes == 8 * exporter.owner.config.block_bytes
        assert outcome.header().startswith("outcome=ok blocks=8 ")
        assert seen == [outcome]

    async def test_requests_of_one_prefix_share_one_pull(self, make_peer: PeerFactory) -> None:
        """Two requests moved here with the same prefix at once: one pull; the second waits
        for it (and reports no blocks of its own), so both engines find the blocks."""
        exporter, importer = await make_peer(), await make_peer()
        exporter.put(KEYS)
        puller = PrefixPuller(importer.service)
        source = PrefixSource(exporter.url, [k[1] for k in KEYS])
        first, second = await asyncio.gather(puller.pull(source, "a"), puller.pull(source, "b"))
        assert (first.blocks, second.blocks, first.error, second.error) == (8, 0, None, None)
        assert importer.service.stats().by_transport[Transport.SHM].num_pulls == 1
        for key in KEYS:
            np.testing.assert_array_equal(importer.read(key), content(key))

    async def test_a_dead_holder_is_a_failed_pull_not_an_error(
            self, make_peer: PeerFactory) -> None:
        """The holder's sidecar is gone: the outcome says so; nothing is raised or kept."""
        importer = await make_peer()
        with socket.socket() as probe:  # a port that nothing listens on
            probe.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
        outcome = await PrefixPuller(importer.service).pull(PrefixSource(dead, [1, 2]), "r2")
        assert (outcome.error, outcome.blocks) == ("peer_unavailable", 0)
        assert outcome.header().startswith("outcome=failed:peer_unavailable ")
        assert_untouched(importer)

    async def test_no_store_is_a_failed_pull(self) -> None:
        """A sidecar without a block store cannot pull: the engine recomputes."""
        outcome = await PrefixPuller(None).pull(PrefixSource("http://x", [1]), "r3")
        assert outcome.error == "no_store"
