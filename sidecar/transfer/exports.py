"""The exporter's open exports: leased blocks waiting for a peer to read them.

An export is one ``LocalSession`` on this sidecar's store holding leases on the blocks a
peer asked for, so they cannot be evicted or reused while the peer copies them. It ends in
one of three ways, each of which closes the session and so releases every lease:

* the importer confirms (``release``): its copy saw the committed bytes;
* the TCP stream that carries it finishes or breaks;
* its TTL passes first (the importer died, hung or gave up): ``expire`` drops it, and a
  late release is answered ``ExportGoneError``, so the importer discards what it read.

Exports serve NIXL and TCP pulls. A same-host (shm) pull leases through the store's own
socket instead, where the leases die with the importer's connection.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import structlog

from shm.owner.local import LocalSession
from shm.owner.server import BlockStoreOwner
from sidecar.transfer.errors import UnknownBlocksError
from sidecar.transfer.messages import BlockKey, Transport

__all__ = ["Export", "ExportTable"]

log = structlog.get_logger(component="transfer")


@dataclass(slots=True)
class Export:
    """One open export; ``session`` holds its leases until ``ExportTable.close``."""

    export_id: str
    transport: Transport
    keys: list[BlockKey]
    slots: list[int]
    generations: list[int]
    deadline: float  # time.monotonic() after which the leases lapse
    session: LocalSession


class ExportTable:
    """Open exports by id; the owner of every export lease."""

    def __init__(self, owner: BlockStoreOwner) -> None:
        self._owner = owner
        self._exports: dict[str, Export] = {}
        self.num_opened = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._exports)

    def open(self, keys: list[BlockKey], transport: Transport, ttl_s: float) -> Export:
        """Lease every key, or lease none and raise ``UnknownBlocksError`` naming the missing."""
        session = LocalSession(self._owner)
        try:
            reply = session.lease(keys)
            missing = [k for k, s in zip(keys, reply.slots, strict=True) if s is None]
            if missing:
                shown = ", ".join(f"({ns}, {h})" for ns, h in missing[:4])
                more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
                raise UnknownBlocksError(
                    f"{len(missing)} of {len(keys)} blocks are not held here: {shown}{more}",
                    missing,
                )
        except BaseException:
            session.close()
            raise
        export = Export(
            export_id=uuid.uuid4().hex,
            transport=transport,
            keys=keys,
            slots=reply.slots,  # type: ignore[arg-type]  # no None left
            generations=reply.generations,  # type: ignore[arg-type]
            deadline=time.monotonic() + ttl_s,
            session=session,
        )
        self._exports[export.export_id] = export
        self.num_opened += 1
        return export

    def take(self, export_id: str) -> Export | None:
        """Remove and return a live export (``None`` if unknown or lapsed)."""
        export = self._exports.pop(export_id, None)
        if export is not None and time.monotonic() > export.deadline:
            self._lapse(export)
            return None
        return export

    def close(self, export: Export) -> None:
        """Release the export's leases (idempotent)."""
        self._exports.pop(export.export_id, None)
        export.session.close()

    def expire(self) -> int:
        """Drop exports past their deadline; how many."""
        now = time.monotonic()
        lapsed = [e for e in self._exports.values() if now > e.deadline]
        for export in lapsed:
            del self._exports[export.export_id]
            self._lapse(export)
        return len(lapsed)

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self._exports.values()), default=None)

    def _lapse(self, export: Export) -> None:
        export.session.close()
        self.num_expired += 1
        log.warning("block_export_expired", export_id=export.export_id,
                    transport=export.transport.value, num_blocks=len(export.keys))

    def close_all(self) -> None:
        for export in list(self._exports.values()):
            self.close(export)
