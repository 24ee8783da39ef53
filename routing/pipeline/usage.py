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


def count_usage_in_sse(m: GatewayMetrics, worker_id: str, piece: bytes) -> None:
    """Count the usage of every complete ``data:`` event in ``piece`` that carries one."""
    for event in piece.split(b"\n\n"):
        if b'"usage":{' in event and event.startswith(b"data:"):
            try:
                _count(m, worker_id, orjson.loads(event[5:]).get("usage"), streamed=True)
            except (orjson.JSONDecodeError, AttributeError):
                pass


def count_usage_in_body(m: GatewayMetrics, worker_id: str, body: bytes) -> None:
    """Count the usage of a non-streaming reply."""
    if b'"usage"' not in body:
        return
    try:
        _count(m, worker_id, orjson.loads(body).get("usage"), streamed=False)
    except (orjson.JSONDecodeError, AttributeError):
        pass


def _count(m: GatewayMetrics, worker_id: str, usage: object, streamed: bool) -> None:
    if type(usage) is not dict:
        return
    m.requests_with_usage += 1
    prompt = usage.get("prompt_tokens")
    if type(prompt) is int:
        m.usage_prompt_tokens += prompt
    if not streamed:
        completion = usage.get("completion_tokens")
        if type(completion) is int:
            m.completion_tokens += completion
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else None
    if type(cached) is int:
        m.actual_cached_tokens += cached
        table = m.worker_actual_cached_tokens
        table[worker_id] = table.get(worker_id, 0) + cached
