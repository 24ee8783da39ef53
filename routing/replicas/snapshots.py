"""Index snapshots in JetStream's object store (``--events-via nats``).

Each gateway writes its own object, ``index-<replica id>``, in the model's bucket
(``kvcore.jetstream.snapshot_bucket``) every ``--snapshot-interval-s``; a starting gateway
loads the newest, the one covering the highest stream sequence (kept in the object's
description, so choosing reads no snapshot). No election: writers never conflict, and a dead
gateway's object only loses to a newer one (the bucket drops objects older than
``_BUCKET_TTL_S``).

A snapshot is one version byte and one msgpack ``DurableSnapshot``: the model, the block
size, the stream sequence it covers, and the index as its own arrays (``IndexImage``).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated, Any

import msgspec
import structlog
from msgspec import Meta

from kvcore.events import Counter
from kvcore.jetstream import snapshot_bucket
from kvcore.wire import WireError
from routing.placement.index_image import IndexImage

__all__ = ["DurableSnapshot", "SnapshotStore", "decode_snapshot", "encode_snapshot"]

log = structlog.get_logger("routing.replicas", component="snapshots")

_VERSION = 2  # 2: IndexImage version 2 (per-worker arrays)
_BUCKET_TTL_S = 24 * 3600.0
_CHUNK_BYTES = 512 << 10
_encoder = msgspec.msgpack.Encoder()


class DurableSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A gateway's index after stream message ``stream_seq``: replay from the next one."""

    model_id: str
    block_size: Annotated[int, Meta(ge=1, le=4096)]
    stream_seq: Counter
    image: IndexImage


_decoder = msgspec.msgpack.Decoder(DurableSnapshot)


def encode_snapshot(snapshot: DurableSnapshot) -> bytes:
    buf = bytearray(b"\x00")
    buf[0] = _VERSION
    _encoder.encode_into(snapshot, buf, 1)
    return bytes(buf)


def decode_snapshot(data: bytes | memoryview) -> DurableSnapshot:
    """The snapshot in ``data``; ``WireError`` on anything else."""
    view = memoryview(data)
    if len(view) < 2 or view[0] != _VERSION:
        raise WireError(f"not an index snapshot of version {_VERSION} "
                        f"(head: {bytes(view[:16]).hex()})")
    try:
        return _decoder.decode(view[1:])
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise WireError(f"invalid index snapshot: {exc}") from exc


class SnapshotStore:
    """The model's snapshot bucket, through one JetStream context."""

    def __init__(self, nats: Any, js: Any, model_id: str) -> None:
        self._nats = nats
        self._js = js
        self.bucket = snapshot_bucket(model_id)
        self._store: Any = None

    async def _bucket(self, create: bool) -> Any:
        if self._store is None:
            try:
                self._store = await self._js.object_store(self.bucket)
            except self._nats.js.errors.NotFoundError:
                if not create:
                    return None
                self._store = await self._js.create_object_store(
                    self.bucket, ttl=_BUCKET_TTL_S,
                    description="kvsidecar gateways' index snapshots (docs/replicas.md)")
        return self._store

    async def write(self, key: str, stream_seq: int, frame: bytes) -> None:
        store = await self._bucket(create=True)
        api = self._nats.js.api
        meta = api.ObjectMeta(name=key, description=str(stream_seq),
                              options=api.ObjectMetaOptions(max_chunk_size=_CHUNK_BYTES))
        await store.put(key, frame, meta=meta)

    async def read_newest(self) -> bytes | None:
        """The newest snapshot's bytes; None when there is none."""
        store = await self._bucket(create=False)
        if store is None:
            return None
        try:
            infos = await store.list(ignore_deletes=True)
        except self._nats.js.errors.NotFoundError:
            return None
        newest = max(infos, key=_covered, default=None)
        if newest is None or _covered(newest) < 0:
            return None
        data = await self._chunks(newest)
        log.info("snapshot_found", name=newest.name, stream_seq=_covered(newest),
                 bytes=len(data))
        return data

    async def _chunks(self, info: Any) -> bytes:
        """The object's chunks, by direct gets, checked against its digest. (Not the object
        store's ``get``: its ordered consumer answers flow control only every 0.25 s, which
        stalls a transfer of megabytes for most of a second.)"""
        templates = self._nats.js.object_store
        stream = templates.OBJ_STREAM_TEMPLATE.format(bucket=self.bucket)
        subject = templates.OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
        parts, digest, seq = [], hashlib.sha256(), 1
        for _ in range(info.chunks or 0):
            msg = await self._js.get_msg(stream, seq=seq, subject=subject, next=True,
                                         direct=True)
            parts.append(msg.data or b"")
            digest.update(parts[-1])
            seq = msg.seq + 1
        data = b"".join(parts)
        try:
            expected = base64.urlsafe_b64decode((info.digest or "").partition("=")[2])
        except ValueError:
            expected = b""
        if len(data) != info.size or digest.digest() != expected:
            raise WireError(f"snapshot {info.name} does not match its size and digest")
        return data


def _covered(info: Any) -> int:
    """The stream sequence an object's snapshot covers (-1: not one of ours)."""
    description = info.description or ""
    return int(description) if description.isdigit() else -1
