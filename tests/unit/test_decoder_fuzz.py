"""Hostile input to every decoder that reads bytes from outside a process: random bytes, and
valid frames truncated, bit-flipped or extended. Each decoder either returns a value of its
type or raises its one documented error (which the caller turns into a 4xx or a counted,
logged drop); nothing else escapes, nothing hangs.

The decoders: our event wire (gateway ← sidecar), the gateway replicas' wire (NATS), SGLang's
KV-event batches and load readings (ZMQ), TensorRT-LLM's ``/kv_cache_events`` answers, the
block store's control protocol (Unix socket, both ways), the block-transfer requests between
sidecars (HTTP), the OpenAI request bodies the gateway parses, and a remote-tier value read
back from Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.sglang.load_wire import decode_load
from adapters.sglang.wire import (
    BadEvent,
    Batch,
    FrameError,
    SgBlockRemoved,
    SgBlockStored,
    decode_batch_lenient,
)
from adapters.trtllm.wire import PayloadError, decode_envelopes
from kvcore.errors import OpenAIError
from kvcore.events import BlockRemoved, BlockStored, Tier
from kvcore.wire import WireError, decode, encode
from routing.placement.prefix_index import PrefixIndex
from routing.prompt.openai_api import Endpoint, parse_request
from routing.replicas.messages import Placed, ReplicaBatch, decode_batch
from routing.replicas.messages import encode as encode_replica
from shm.block_names import BlockName
from shm.errors import ProtocolError
from shm.protocol import Lease, Slots, decode_reply, decode_request
from shm.protocol import encode as encode_shm
from shm.tiers.remote_keys import check_value, pack_value
from sidecar.transfer.errors import BadTransferRequestError
from sidecar.transfer.messages import ExportRequest, Transport
from sidecar.transfer.messages import decode as decode_transfer


def test_the_seeds_are_valid() -> None:
    """Mutations of valid frames reach past the first check: each seed decodes whole."""
    assert isinstance(decode(_EVENT), BlockStored)
    assert decode_batch(_BATCH).events
    assert not any(isinstance(e, BadEvent) for e in decode_batch_lenient(_SG_BATCH)[1])
    assert [type(e).__name__ for e in decode_envelopes(_TRT)] == ["_PlainEnvelope"]
    assert isinstance(decode_request(_LEASE), Lease) and isinstance(decode_reply(_SLOTS), Slots)
    assert decode_transfer(_EXPORT, ExportRequest).block_bytes == 4096
    assert parse_request(Endpoint.CHAT, _CHAT).max_tokens == 4
    assert check_value(_VALUE, (1, 2), 64, np.zeros(64, np.uint8)) is None


FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` cut short, with a byte flipped, or with bytes appended; or random bytes."""
    n = len(valid)
    return st.one_of(
        st.binary(max_size=2 * n + 16),
        st.integers(0, max(0, n - 1)).map(lambda k: valid[:k]),
        st.tuples(st.integers(0, n - 1), st.integers(1, 255)).map(
            lambda t: valid[: t[0]] + bytes([valid[t[0]] ^ t[1]]) + valid[t[0] + 1 :]),
        st.binary(min_size=1, max_size=32).map(lambda tail: valid + tail),
    )


def only(error: type[BaseException] | tuple[type[BaseException], ...],
         fn: Callable[[bytes], Any], raw: bytes) -> None:
    try:
        fn(raw)
    except error:
        pass


_EVENT = encode(BlockStored("w0", 1, 7, Tier.GPU, [11, 12, 13], 10, list(range(48))))
_REMOVED = encode(BlockRemoved("w0", 1, 8, Tier.HOST, [12, 13]))


@FUZZ
@given(st.one_of(mutations(_EVENT), mutations(_REMOVED)))
def test_our_event_wire_and_the_index_behind_it(raw: bytes) -> None:
    """A frame that decodes is applied to an index without error (the gateway's feed)."""
    try:
        message = decode(raw)
    except WireError:
        return
    if isinstance(message, BlockStored | BlockRemoved):
        PrefixIndex().apply(message)


_BATCH = encode_replica(ReplicaBatch("gw-a", 3, False, [Placed("k1", "w0", [1, 2, 3], 48, 48)]))


@FUZZ
@given(mutations(_BATCH))
def test_the_replica_wire(raw: bytes) -> None:
    only(WireError, decode_batch, raw)


_SG_BATCH = msgspec.msgpack.encode(Batch(1.5, [
    SgBlockStored([1, 2], None, list(range(32)), 16, None, "GPU"),
    SgBlockRemoved([1], "GPU")], 0))


@FUZZ
@given(mutations(_SG_BATCH))
def test_sglang_event_batches(raw: bytes) -> None:
    only(FrameError, decode_batch_lenient, raw)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_sglang_load_readings(frames: list[bytes]) -> None:
    try:
        decode_load(frames)
    except FrameError:
        pass


_TRT = (b'[{"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": '
        b'[{"type": "stored_block", "block_hash": 5, "tokens": [{"token_id": 1}], '
        b'"lora_id": null, "cache_level": 0, "priority": 35}]}, "window_size": 32}]')


@FUZZ
@given(mutations(_TRT))
def test_trtllm_event_answers(raw: bytes) -> None:
    only(PayloadError, decode_envelopes, raw)


_LEASE = encode_shm(Lease([1, 1], [5, 6]))[4:]  # the body after the length prefix
_SLOTS = encode_shm(Slots([0, None], [3, None]))[4:]


@FUZZ
@given(st.one_of(mutations(_LEASE), mutations(_SLOTS)))
def test_the_block_store_protocol(raw: bytes) -> None:
    only(ProtocolError, decode_request, raw)
    only(ProtocolError, decode_reply, raw)


_EXPORT = msgspec.json.encode(ExportRequest([(1, 2), (3, 4)], Transport.SHM, 4096, "uint8", 5.0))


@FUZZ
@given(mutations(_EXPORT))
def test_block_transfer_requests(raw: bytes) -> None:
    only(BadTransferRequestError, lambda r: decode_transfer(r, ExportRequest), raw)


_CHAT = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
         b'"stream": true, "temperature": 0, "stop": ["x"], "logit_bias": {"1": 2}}')
_COMPLETION = b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "n": 1}'


@FUZZ
@given(st.one_of(mutations(_CHAT), mutations(_COMPLETION)),
       st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS]))
def test_openai_request_bodies(raw: bytes, endpoint: Endpoint) -> None:
    only(OpenAIError, lambda r: parse_request(endpoint, r), raw)


_VALUE = pack_value((1, 2), BlockName(9, 8), np.arange(64, dtype=np.uint8))


@FUZZ
@given(mutations(_VALUE))
def test_a_remote_tier_value(raw: bytes) -> None:
    """A value read back is the block written, byte for byte, or a named problem."""
    dst = np.zeros(64, np.uint8)
    if check_value(raw, (1, 2), 64, dst) is None:
        assert (dst == np.arange(64, dtype=np.uint8)).all()
