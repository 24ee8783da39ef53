"""What optimistic clients tell the owner through the read index: hits and publications.

Each client the owner serves gets a cell of the segment's read index (``shm.read_index``),
given back when it goes: there it counts its optimistic hits (for the owner's statistics)
and its publications. A publication commits the slots a writer published (its put), with
no message, so before each request, and on its poll, the owner records the commits of the
clients whose publication count moved: a few integer compares when none did.
"""

from __future__ import annotations

import collections

from shm.owner.store import BlockStore, SessionId
from shm.read_index import MAX_HIT_CELLS, ReadIndex

__all__ = ["ClientCells"]


class ClientCells:
    """The read index's per-client cells, handed out to sessions and read back."""

    def __init__(self, index: ReadIndex, store: BlockStore) -> None:
        self._index = index
        self._store = store
        # Oldest-freed first: a client the owner dropped may still count hits in its old
        # cell until it notices, so a freed cell goes to the back of the line.
        self._free = collections.deque(range(MAX_HIT_CELLS))
        self._cell_of: dict[SessionId, int] = {}
        self._publications_seen: dict[SessionId, int] = {}  # per session, its cell's count
        self._retired_hits = 0  # counted in the cells of clients now gone

    def open(self, session: SessionId) -> None:
        """Give ``session`` a cell, if one is free (else its client leases every read:
        1,024 clients attached)."""
        if self._free:
            cell = self._cell_of[session] = self._free.popleft()
            self._store.attach_cell(session, cell)

    def cell_of(self, session: SessionId) -> int:
        """``session``'s cell; -1: none."""
        return self._cell_of.get(session, -1)

    def close(self, session: SessionId) -> None:
        """Keep the hits ``session`` counted and free its cell."""
        cell = self._cell_of.pop(session, None)
        self._publications_seen.pop(session, None)
        if cell is None:
            return
        index = self._index
        self._retired_hits += int(index.hit_cells[cell])
        index.hit_cells[cell] = 0
        index.count_publication(cell, 0)
        self._free.append(cell)

    def record_publications(self) -> int:
        """Commit what writers have published since we last looked: the reservations of
        the clients whose publication count moved (``BlockStore.commit_published``). How
        many blocks."""
        index, seen = self._index, self._publications_seen
        moved = []
        for session, cell in self._cell_of.items():
            count = index.publications(cell)  # read before the slots: a later one moves it
            if count != seen.get(session, 0):
                seen[session] = count
                moved.append(session)
        return self._store.commit_published(moved) if moved else 0

    def optimistic_hits(self) -> int:
        """Hits clients read through the read index, those now gone included."""
        cells = self._index.hit_cells
        return self._retired_hits + sum(int(cells[c]) for c in self._cell_of.values())
