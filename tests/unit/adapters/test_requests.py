"""Request translation: tokenized OpenAI → SGLang /generate and trtllm-serve, and back."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from adapters.base import LoraAdapter
from adapters.normalize_openai import error_from_engine
from adapters.sglang.requests import SGLangResponseTranslator, to_generate_request
from adapters.trtllm.requests import TrtllmResponseTranslator, to_completions_request
from kvcore.errors import OpenAIError
from kvcore.requests import (
    Bootstrap,
    Continuation,
    EngineOpenAI,
    RequestKind,
    TokenizedRequest,
)


def request(**kw: Any) -> TokenizedRequest:
    base: dict[str, Any] = {
        "request_id": "r1",
        "model": "tiny",
        "kind": RequestKind.COMPLETION,
        "prompt_token_ids": [1, 2, 3],
    }
    base.update(kw)
    return TokenizedRequest(**base)


def meta(finish: Any = None, cached: int | None = 2, completion: int = 1) -> dict:
    out: dict[str, Any] = {
        "id": "r1",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "completion_tokens": completion,
    }
    if cached is not None:
        out["cached_tokens"] = cached
    return out


def test_tokenized_request_validates() -> None:
    """Empty prompts, n > 1 and a negative min_tokens are refused with a clear message."""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        request(prompt_token_ids=[])
    with pytest.raises(ValueError, match="n=2"):
        request(n=2)
    with pytest.raises(ValueError, match="min_tokens"):
        request(min_tokens=-1)


def test_generate_body_carries_ids_sampling_and_routing() -> None:
    """/generate gets input_ids, SGLang's sampling names, salt, LoRA, DP rank and extras."""
    req = request(
        stream=True,
        max_tokens=8,
        min_tokens=4,
        temperature=0.5,
        seed=3,
        stop=["x"],
        ignore_eos=True,
        cache_salt="t",
        lora_name="ad",
        dp_rank=1,
        extra={"bootstrap_room": 9},
    )
    native = to_generate_request(req)
    assert native.path == "/generate" and native.stream
    assert native.body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 8,
            "min_new_tokens": 4,
            "temperature": 0.5,
            "sampling_seed": 3,
            "stop": ["x"],
            "ignore_eos": True,
        },
        "stream": True,
        "rid": "r1",
        "lora_path": "ad",
        "cache_salt": "t",
        "routed_dp_rank": 1,
        "bootstrap_room": 9,
    }
    with pytest.raises(ValueError, match="overwrite"):
        to_generate_request(request(extra={"input_ids": [0]}))


def test_sglang_cumulative_stream_becomes_deltas_with_cached_usage() -> None:
    """Cumulative /generate text turns into deltas; cached_tokens lands in the usage chunk."""
    tr = SGLangResponseTranslator(request(stream=True, include_usage=True), created=1)
    chunks = tr.chunk({"text": "He", "meta_info": meta()})
    chunks += tr.chunk({"text": "Hello", "meta_info": meta(completion=2)})
    chunks += tr.chunk({"text": "Hello", "meta_info": meta({"type": "length", "length": 3}, 2, 3)})
    chunks += tr.finish()
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["He", "llo", ""]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["object"] == "text_completion" and chunks[0]["id"] == "cmpl-r1"
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_sglang_incremental_stream_as_chat_chunks() -> None:
    """With incremental output each chunk is a delta; chat chunks carry the role once."""
    tr = SGLangResponseTranslator(
        request(kind=RequestKind.CHAT, stream=True), incremental=True, created=1
    )
    a = tr.chunk({"text": "Hi", "meta_info": meta()})
    b = tr.chunk({"text": " there", "meta_info": meta({"type": "stop", "matched": 2})})
    assert a[0]["object"] == "chat.completion.chunk"
    assert a[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert b[0]["choices"][0]["delta"] == {"content": " there"}
    assert b[0]["choices"][0]["finish_reason"] == "stop"
    assert tr.finish() == []  # usage not asked for


def test_sglang_whole_response() -> None:
    """A non-streaming /generate answer becomes a chat.completion with usage."""
    tr = SGLangResponseTranslator(request(kind=RequestKind.CHAT), created=1)
    body = tr.response({"text": "ok", "meta_info": meta({"type": "stop"}, cached=0)})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize(
    ("status", "body", "message", "kind"),
    [
        (400, {"error": {"message": "bad ids"}}, "bad ids", "invalid_request_error"),
        (400, {"error": "The input is too long"}, "The input is too long", "invalid_request_error"),
        (
            400,
            {"object": "error", "message": "field x", "type": "Bad Request", "code": 400},
            "field x",
            "invalid_request_error",
        ),
        (404, {"detail": "Not Found"}, "Not Found", "invalid_request_error"),
        (503, b"upstream gone", "sglang engine error: upstream gone", "server_error"),
    ],
)
def test_engine_error_bodies_become_openai_errors(
    status: int, body: Any, message: str, kind: str
) -> None:
    """Each SGLang error shape (and plain text) maps to OpenAI's error object."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    err = SGLangResponseTranslator(request()).error(status, raw)
    assert err.status == status
    assert err.to_dict()["error"]["message"] == message
    assert err.to_dict()["error"]["type"] == kind
    assert err.to_dict()["error"]["code"] is None  # never the engine's numeric code


def test_streamed_error_and_abort_raise_openai_errors() -> None:
    """An error object in the stream or an abort finish reason raises OpenAIError."""
    tr = SGLangResponseTranslator(request(stream=True))
    with pytest.raises(OpenAIError, match="too long") as info:
        tr.chunk({"error": {"message": "too long", "type": "invalid_request_error", "code": 400}})
    assert info.value.status == 400
    with pytest.raises(OpenAIError, match="out of memory") as info:
        tr.chunk(
            {
                "text": "",
                "meta_info": meta(
                    {"type": "abort", "message": "out of memory", "status_code": 503}
                ),
            }
        )
    assert info.value.status == 503


def test_completions_body_for_trtllm() -> None:
    """trtllm-serve gets a token-id prompt with OpenAI sampling names and stream options."""
    native = to_completions_request(
        request(stream=True, include_usage=True, max_tokens=4, min_tokens=2, top_k=5)
    )
    assert native.path == "/v1/completions"
    assert native.body == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "stream": True,
        "max_tokens": 4,
        "min_tokens": 2,
        "top_k": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }


def test_trtllm_lora_goes_by_id_and_checkpoint_and_salt_is_refused() -> None:
    """trtllm-serve selects an adapter by a full lora_request; an adapter the sidecar was not
    told about, or a cache_salt its completions model lacks, is a clear refusal, never a
    request served without them."""
    adapters = {"ad": LoraAdapter("ad", 3, "/ckpt/ad")}
    native = to_completions_request(request(lora_name="ad"), adapters)
    assert native.body["lora_request"] == {
        "lora_name": "ad", "lora_int_id": 3, "lora_path": "/ckpt/ad"}
    with pytest.raises(ValueError, match=r"'other' is not one this sidecar knows \(known: ad\)"):
        to_completions_request(request(lora_name="other"), adapters)
    with pytest.raises(ValueError, match="--lora-adapter NAME=ID"):
        to_completions_request(request(lora_name="ad"))
    with pytest.raises(ValueError, match="takes no cache_salt"):
        to_completions_request(request(cache_salt="tenant-a"), adapters)


def test_trtllm_completion_stream_rebuilt_as_chat() -> None:
    """Completion chunks from trtllm-serve come back as chat chunks plus a usage chunk."""
    tr = TrtllmResponseTranslator(
        request(kind=RequestKind.CHAT, stream=True, include_usage=True), created=1
    )
    out = tr.chunk({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})
    out += tr.chunk({"choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]})
    out += tr.chunk(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 1},
            },
        }
    )
    out += tr.finish()
    assert [c["choices"][0]["delta"].get("content") for c in out[:2]] == ["Hi", "!"]
    assert out[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_trtllm_error_response() -> None:
    """trtllm-serve's ErrorResponse maps to the OpenAI error with its status."""
    tr = TrtllmResponseTranslator(request())
    with pytest.raises(OpenAIError, match="prompt too long"):
        tr.response(
            {"object": "error", "message": "prompt too long", "type": "BadRequest", "code": 400}
        )
    err = error_from_engine("trtllm", 500, b"")
    assert err.message == "trtllm engine error: empty error reply with status 500"


def test_an_openai_body_goes_to_the_engines_own_openai_server() -> None:
    """With the client's body, both engines get it on their OpenAI route, as it came (SGLang
    also gets the request id), and its answers are marked as OpenAI's already."""
    openai = EngineOpenAI("/v1/chat/completions",
                          {"model": "alias", "messages": [], "logprobs": True, "stream": True})
    req = request(openai=openai, n=2)
    sglang = to_generate_request(req)
    assert (sglang.path, sglang.openai, sglang.stream) == ("/v1/chat/completions", True, True)
    assert sglang.body == {"model": "alias", "messages": [], "logprobs": True, "stream": True,
                           "rid": "r1"}
    trtllm = to_completions_request(req)
    assert trtllm.path == "/v1/chat/completions" and "rid" not in trtllm.body
    with pytest.raises(ValueError, match="token ids"):
        to_generate_request(request(openai=openai, bootstrap=Bootstrap("prefill", "h", 1, 2)))


def test_sglang_stream_says_which_tokens_each_chunk_carries() -> None:
    """Cumulative or incremental output_ids become the ids of each returned chunk; ids of
    a chunk held back (no text yet) go with the next; no output_ids: not reported."""
    tr = SGLangResponseTranslator(request(stream=True), created=1)
    assert tr.chunk({"text": "He", "output_ids": [7], "meta_info": meta()})
    assert tr.token_ids() == [7]
    assert tr.chunk({"text": "He", "output_ids": [7, 8], "meta_info": meta()}) == []
    assert tr.chunk({"text": "Hello", "output_ids": [7, 8, 9], "meta_info": meta()})
    assert tr.token_ids() == [8, 9]
    inc = SGLangResponseTranslator(request(stream=True), incremental=True, created=1)
    inc.chunk({"text": "a", "output_ids": [4], "meta_info": meta()})
    inc.chunk({"text": "b", "output_ids": [5], "meta_info": meta()})
    assert inc.token_ids() == [4, 5]
    blind = SGLangResponseTranslator(request(stream=True), created=1)
    blind.chunk({"text": "a", "meta_info": meta()})
    assert blind.token_ids() is None
    assert TrtllmResponseTranslator(request(stream=True)).token_ids() is None


def test_a_continuation_reads_as_the_rest_of_the_first_stream() -> None:
    """The engine runs prompt + streamed tokens with what is left of max_tokens; the chunks
    keep the stream's created, send no role again, and usage counts from the prompt."""
    cont = Continuation([10, 11], created=42)
    req = request(kind=RequestKind.CHAT, stream=True, include_usage=True, max_tokens=5,
                  continuation=cont)
    engine = req.for_engine()
    assert engine.prompt_token_ids == [1, 2, 3, 10, 11] and engine.max_tokens == 3
    assert engine.continuation is None and request().for_engine() == request()
    tr = SGLangResponseTranslator(req, incremental=True)
    first = tr.chunk({"text": "x", "output_ids": [12], "meta_info": meta()})[0]
    assert first["created"] == 42 and first["choices"][0]["delta"] == {"content": "x"}
    tr.chunk({"text": "y", "output_ids": [13], "meta_info": {
        **meta({"type": "length"}, cached=5, completion=3), "prompt_tokens": 5}})
    usage = tr.finish()[0]["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                     "prompt_tokens_details": {"cached_tokens": 3}}


def test_a_continuation_is_checked() -> None:
    """Only a token-id stream resumes, from some tokens, with tokens left to generate."""
    with pytest.raises(ValueError, match="resumes a stream"):
        request(continuation=Continuation([1]))
    with pytest.raises(ValueError, match="output token ids"):
        request(stream=True, continuation=Continuation([]))
    with pytest.raises(ValueError, match="nothing of max_tokens=2"):
        request(stream=True, max_tokens=2, continuation=Continuation([1, 2]))
