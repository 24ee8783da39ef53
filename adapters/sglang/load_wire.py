"""SGLang's scheduler load messages (``load_publisher.py`` in
``sglang/srt/managers/scheduler_components``, 0.5.23), decoded.

A scheduler that publishes KV events can also publish its load (SGLang's
``--load-publish-endpoint``) on a PUB socket of its own: DP rank ``r`` at
``load_endpoint_port_base + r`` of ``/server_info``'s ``kv_events`` block, subscribed with
its ``load_topic``. A message has the KV-event framing, three frames
``[b"load", seq (8 bytes, big-endian), payload]``, and the payload is a tagged msgpack array::

    ["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens,
     attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
     total_prefill_uncached_tokens, total_prefill_busy_us]

The first four are required and the rest default as in SGLang (a shorter array from an
older SGLang decodes); elements a newer SGLang appends are ignored. ``num_tokens`` is the KV
held by requests (pool size minus free minus evictable cache). It is a gauge: no replay, a
reading dropped at the publisher's high-water mark is superseded by the next, and an
unchanged one is re-sent about once a second.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from adapters.zmq_events.framing import FrameError, parse_seq
from kvcore.stream import EngineLoad

__all__ = ["LOAD_TOPIC", "LoadStat", "decode_load", "to_engine_load"]

LOAD_TOPIC = "load"  # SGLang's LOAD_TOPIC: the SUB filter /server_info advertises
_HEAD = 64

Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]


class LoadStat(msgspec.Struct, tag="LoadStat", array_like=True, frozen=True, gc=False):
    """SGLang's ``LoadStat``, field for field."""

    num_running_reqs: Count
    num_waiting_reqs: Count
    num_tokens: Count  # KV tokens in use
    max_total_num_tokens: Count  # KV capacity; 0 when unknown
    attn_dp_rank: Count | None = None  # informational: the socket says which rank
    num_waiting_uncached_tokens: Count = 0
    num_total_tokens: Count = 0
    max_running_requests: Count = 0
    total_prefill_uncached_tokens: Count = 0
    total_prefill_busy_us: Count = 0


_decoder = msgspec.msgpack.Decoder(LoadStat)


def decode_load(frames: list[bytes]) -> tuple[int, LoadStat]:
    """(seq, reading) of one load message; ``FrameError`` saying what is wrong otherwise."""
    if len(frames) != 3:
        raise FrameError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    seq = parse_seq(frames[1])
    payload = frames[2]
    try:
        stat = _decoder.decode(payload)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise FrameError(
            f"payload of {len(payload)} bytes is not an SGLang LoadStat: {exc} "
            f"(head: {payload[:_HEAD].hex()})"
        ) from exc
    return seq, stat


def to_engine_load(stat: LoadStat, age_ms: int = 0) -> EngineLoad:
    """The canonical reading of one ``LoadStat``."""
    return EngineLoad(
        running=stat.num_running_reqs,
        queued=stat.num_waiting_reqs,
        kv_used_tokens=stat.num_tokens,
        kv_capacity_tokens=stat.max_total_num_tokens or None,
        queued_prefill_tokens=stat.num_waiting_uncached_tokens,
        age_ms=age_ms,
    )
