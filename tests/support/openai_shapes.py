"""Replies checked against SGLang's own OpenAI response models (``protocol.py`` of SGLang
0.5.23): a whole chat or completion, each streamed chunk, and the OpenAI error object.

SGLang's module is imported once, on first use (it takes seconds, and its imports warn about
missing CUDA kernels, which ``filterwarnings = error`` would turn into failures).
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Any

__all__ = ["check_error", "check_reply", "check_stream_chunk"]


@functools.cache
def _protocol() -> ModuleType:
    from tests.support.sglang_shim import stub_vision_modules

    stub_vision_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.entrypoints.openai import protocol  # type: ignore[import-untyped]

    return protocol  # type: ignore[no-any-return]


def check_reply(body: dict[str, Any], chat: bool) -> Any:
    """``body`` validated as SGLang's ``ChatCompletionResponse`` / ``CompletionResponse``."""
    p = _protocol()
    model = p.ChatCompletionResponse if chat else p.CompletionResponse
    expected = "chat.completion" if chat else "text_completion"
    assert body.get("object") == expected, body
    return model.model_validate(body)


def check_stream_chunk(chunk: dict[str, Any], chat: bool) -> Any:
    """One SSE chunk validated as ``ChatCompletionStreamResponse`` or
    ``CompletionStreamResponse``."""
    p = _protocol()
    model = p.ChatCompletionStreamResponse if chat else p.CompletionStreamResponse
    expected = "chat.completion.chunk" if chat else "text_completion"
    assert chunk.get("object") == expected, chunk
    return model.model_validate(chunk)


def check_error(body: Any) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    return dict(error)
