"""The decode leg's answer as one request's: SGLang ``/generate`` objects, stitched.

The prefill engine produced the first token; the decode engine continues from
``prompt + [first]`` and reports only what it generated. ``stitched`` rewrites each of the
decode engine's (cumulative) objects as the aggregated engine would have sent it: the first
token's id and text prepended, usage counted against the client's prompt, so the adapter's
response translator turns the pair into one OpenAI stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import orjson

from kvcore.requests import TokenizedRequest

__all__ = ["EngineRefusedError", "PrefillResult", "message_of", "meta_info", "sse", "stitched"]


class PrefillResult(msgspec.Struct, frozen=True):
    """The prefill leg's answer (``POST /v1/kvsidecar/pd/prefill``)."""

    output_ids: list[int]
    text: str
    finish_reason: Any
    cached_tokens: int
    page_keys: list[str]
    seconds: float


class EngineRefusedError(Exception):
    """The decode engine answered an error (409: it could not import the prompt's pages)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def message_of(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except orjson.JSONDecodeError:
        pass
    return raw[:200].decode(errors="replace")


def meta_info(
    tokenized: TokenizedRequest, prefill: PrefillResult, finish: Any, decoded: int
) -> dict[str, Any]:
    return {
        "prompt_tokens": len(tokenized.prompt_token_ids),
        "completion_tokens": len(prefill.output_ids) + decoded,
        "cached_tokens": prefill.cached_tokens,
        "finish_reason": finish,
    }


async def stitched(
    tokenized: TokenizedRequest,
    prefill: PrefillResult,
    head: dict[str, Any],
    rest: AsyncIterator[dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    """The decode engine's objects rewritten as one request's: the first token prepended."""
    data: dict[str, Any] | None = head
    while data is not None:
        meta = data.get("meta_info") or {}
        ids = data.get("output_ids") or []
        yield {
            "text": prefill.text + str(data.get("text") or ""),
            "output_ids": [*prefill.output_ids, *ids],
            "meta_info": meta_info(tokenized, prefill, meta.get("finish_reason"), len(ids)),
        }
        data = await anext(rest, None)


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"
