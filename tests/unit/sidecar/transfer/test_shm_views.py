"""The shm additions the transfers stand on: in-process sessions and read-only mappings."""

from __future__ import annotations

import numpy as np
import pytest

from shm import ForeignSegmentError
from shm.client.readonly import ReadOnlySegment
from shm.owner.local import LocalSession
from tests.support.transfer_peers import PeerFactory, content


async def test_local_session_close_frees_reservations_and_leases(make_peer: PeerFactory) -> None:
    """Closing a session drops its uncommitted slots and its leases, like a dead client."""
    peer = await make_peer()
    peer.put([(1, 1)])
    session = LocalSession(peer.owner)
    session.reserve([(1, 2), (1, 3)])
    session.lease([(1, 1)])
    stats = peer.owner.stats()
    assert (stats.num_reserved, stats.num_leased_blocks) == (2, 1)
    session.close()
    stats = peer.owner.stats()
    assert (stats.num_blocks, stats.num_reserved, stats.num_leased_blocks) == (1, 0, 0)


async def test_read_only_mapping_sees_committed_bytes_and_cannot_write(
        make_peer: PeerFactory) -> None:
    """A read-only mapping of another owner's segment reads its slots and refuses writes."""
    peer = await make_peer()
    peer.put([(4, 4)])
    assert peer.owner.segment is not None
    with LocalSession(peer.owner) as session, ReadOnlySegment.attach(
            peer.owner.segment.name, peer.owner.config.owner_id) as segment:
        reply = session.lease([(4, 4)])
        slot, generation = reply.slots[0], reply.generations[0]
        assert slot is not None and generation is not None
        np.testing.assert_array_equal(segment.rows[slot], content((4, 4)))
        assert segment.check_generations([slot], [generation]) == []
        assert segment.check_generations([slot], [generation + 1]) == [slot]
        with pytest.raises(ValueError, match="read-only"):
            segment.rows[slot][0] = 1


async def test_read_only_attach_checks_name_and_owner(make_peer: PeerFactory) -> None:
    """A missing segment is FileNotFoundError; another owner's is ForeignSegmentError."""
    peer = await make_peer()
    assert peer.owner.segment is not None
    with pytest.raises(FileNotFoundError):
        ReadOnlySegment.attach("/kvsidecar-nobody-data-00000000")
    with pytest.raises(ForeignSegmentError):
        ReadOnlySegment.attach(peer.owner.segment.name, "someone-else")
