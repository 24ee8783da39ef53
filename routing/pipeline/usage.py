"""The engines' ``usage`` objects, picked out of replies as they pass through.

Only what the metrics need: prompt tokens, completion tokens (non-streaming; streams are
counted by SSE event) and ``prompt_tokens_details.cached_tokens``, which set against the
overlap predicted at placement shows whether a cache is really working. A reply that does
not parse is the engine's business: it is relayed untouched and simply not counted.
"""

from __future__ import annotations

import orjson

from routing.metrics import GatewayMetrics

__all__ = ["count_usage_in_body", "count_usage_in_sse"]


def count_usage_in_sse(m: GatewayMetrics, worker_id: str, piece: bytes) -> int:
    """Count the usage of every complete ``data:`` event in ``piece`` that carries one;
    returns the last one's cached tokens (-1: none reported)."""
    cached = -1
    for event in piece.split(b"\n\n"):
        if b'"usage":{' in event and event.startswith(b"data:"):
            try:
                cached = _count(m, worker_id, orjson.loads(event[5:]).get("usage"), True)
            except (orjson.JSONDecodeError, AttributeError):
                pass
    return cached


def count_usage_in_body(m: GatewayMetrics, worker_id: str, body: bytes) -> int:
    """Count the usage of a non-streaming reply; returns its cached tokens (-1: none)."""
    if b'"usage"' not in body:
        return -1
    try:
        return _count(m, worker_id, orjson.loads(body).get("usage"), streamed=False)
    except (orjson.JSONDecodeError, AttributeError):
        return -1


def _count(m: GatewayMetrics, worker_id: str, usage: object, streamed: bool) -> int:
    if type(usage) is not dict:
        return -1
    m.requests_with_usage += 1
    prompt = usage.get("prompt_tokens")
    if type(prompt) is int:
        m.usage_prompt_tokens += prompt
        table = m.worker_usage_prompt_tokens
        table[worker_id] = table.get(worker_id, 0) + prompt
    if not streamed:
        completion = usage.get("completion_tokens")
        if type(completion) is int:
            m.completion_tokens += completion
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else None
    if type(cached) is not int:
        return -1
    m.actual_cached_tokens += cached
    table = m.worker_actual_cached_tokens
    table[worker_id] = table.get(worker_id, 0) + cached
    return cached
