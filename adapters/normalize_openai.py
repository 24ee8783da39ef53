"""OpenAI response shapes every adapter produces: completions and chat, whole or streamed.

Engines answer in their own shapes (SGLang's ``/generate``, ``trtllm-serve``'s completions);
the adapters extract (text delta, finish reason, token counts) and build the client's
OpenAI objects here, so both engines answer identically. Errors of either engine's shapes
become ``OpenAIError`` (``kvcore.errors``: one vocabulary, the code a string or null).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvcore.errors import OpenAIError, error_from_reply
from kvcore.requests import RequestKind, TokenizedRequest

__all__ = ["OpenAIBuilder", "ReplyTranslator", "Usage", "error_from_engine"]



@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


class OpenAIBuilder:
    """Builds the OpenAI objects of one request (its id and ``created`` stay fixed)."""

    def __init__(self, request: TokenizedRequest, created: int | None = None) -> None:
        self.request = request
        self.chat = request.kind is RequestKind.CHAT
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.id = (
            request.request_id
            if request.request_id.startswith(prefix)
            else (prefix + request.request_id)
        )
        cont = request.continuation
        if created is None and cont is not None:
            created = cont.created
        self.created = int(time.time()) if created is None else created
        self._role_sent = cont is not None  # a continued stream: the client has the role
        self._resumed = 0 if cont is None else len(cont.output_token_ids)

    def usage(self, engine: Usage) -> Usage:
        """The client's usage from the engine's: a continuation's engine took the tokens
        already streamed as prompt; the client counts them as completion."""
        done = self._resumed
        if not done:
            return engine
        prompt = max(engine.prompt_tokens - done, 0)
        cached = None if engine.cached_tokens is None else min(engine.cached_tokens, prompt)
        return Usage(prompt, engine.completion_tokens + done, cached)

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model}

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """One stream chunk carrying ``text`` (may be empty) and maybe the finish reason."""
        if self.chat:
            delta: dict[str, Any] = {}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            if text or not finish_reason:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        body["choices"] = [choice]
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(usage).body()
        return body

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        """A whole (non-streaming) response."""
        if self.chat:
            body = self._envelope("chat.completion")
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body["choices"] = [choice]
        body["usage"] = self.usage(usage).body()
        return body


def error_from_engine(engine: str, status: int, body: bytes | str | dict[str, Any]) -> OpenAIError:
    """An engine's error reply (any of its known shapes, or plain text) in our vocabulary
    (``kvcore.errors.error_from_reply``); a server error's message names the engine."""
    return error_from_reply(status, body, f"{engine} engine")


class ReplyTranslator:
    """What every engine's reply translator shares (``adapters.base.ResponseTranslator``):
    the builder of the client's objects, the last usage the engine reported, and the
    generated token ids taken from its answers and not yet handed out. A subclass reads its
    engine's shapes (``response``, ``chunk``) and takes ids as they come (``_ids``: None once
    the engine leaves them out, since a partial list would mislead)."""

    def __init__(self, request: TokenizedRequest, engine: str, created: int | None) -> None:
        self.builder = OpenAIBuilder(request, created)
        self._engine = engine
        self._usage: Usage | None = None
        self._ids: list[int] | None = []  # taken, not yet handed out (None: not reported)

    def token_ids(self) -> list[int] | None:
        ids = self._ids
        if ids is None:
            return None
        self._ids = []
        return ids

    def finish(self) -> list[dict[str, Any]]:
        if self.builder.request.include_usage and self._usage is not None:
            return [self.builder.usage_chunk(self._usage)]
        return []

    def cached_tokens(self) -> int | None:
        """None too when a stream carried no usage (the client did not ask for it)."""
        return None if self._usage is None else self._usage.cached_tokens

    def error(self, status: int, body: bytes) -> OpenAIError:
        return error_from_engine(self._engine, status, body)
