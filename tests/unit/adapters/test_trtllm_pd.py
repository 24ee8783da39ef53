"""trtllm-serve's disaggregated legs (``TrtllmPrefillDecode``): the bodies, the handoff state,
the signature and the stitched answer, against objects shaped as trtllm-serve writes them."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import pytest

from adapters.base import AdapterConfig, EngineKind
from adapters.trtllm.adapter import AUTH_KEY_ENV, TrtllmAdapter
from adapters.trtllm.pd import AUTH_HEADER, TrtllmPrefillDecode, auth_header
from adapters.trtllm.requests import TrtllmResponseTranslator, to_completions_request
from kvcore.requests import EngineOpenAI, Handoff, RequestKind, TokenizedRequest

PROMPT = [5, 6, 7, 8, 9]
# choices[0].disaggregated_params of a context_only answer (serve/openai_protocol.py).
CTX_PARAMS = {
    "request_type": "context_only",
    "first_gen_tokens": [42],
    "first_gen_log_probs": None,
    "first_gen_logits": None,
    "ctx_request_id": 7001,
    "encoded_opaque_state": "b3BhcXVlLXN0YXRl",
    "draft_tokens": None,
    "disagg_request_id": 9001,
    "ctx_dp_rank": 1,
    "ctx_info_endpoint": "tcp://10.0.0.1:5000",
    "schedule_style": None,
    "ctx_usage": None,
}


def request(**kw: Any) -> TokenizedRequest:
    base: dict[str, Any] = {"request_id": "r1", "model": "tiny", "kind": RequestKind.COMPLETION,
                            "prompt_token_ids": PROMPT, "max_tokens": 4, "temperature": 0.0,
                            "handoff": Handoff("http://prefill-sidecar")}
    base.update(kw)
    return TokenizedRequest(**base)


def ctx_answer(finish: str | None = "not_finished", params: Any = CTX_PARAMS,
               cached: int = 3) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": " w42", "token_ids": None, "logprobs": None,
                         "finish_reason": finish, "stop_reason": None,
                         "disaggregated_params": params}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "prompt_token_ids": PROMPT}


def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


def usage_chunk(completion: int, cached: int = 5) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": completion,
                                     "total_tokens": 5 + completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}}}


async def objects(*items: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    for item in items:
        yield item


def test_the_prefill_leg_is_the_request_as_context_only() -> None:
    """Not streamed, the client's sampling, and only request_type: nothing the engine did
    not define (trtllm-serve's models forbid extra fields), no rank, no handoff."""
    leg = TrtllmPrefillDecode().prefill_request(request(stream=True, include_usage=True,
                                                        dp_rank=1))
    assert (leg.path, leg.stream, dict(leg.headers)) == ("/v1/completions", False, {})
    assert leg.body == {"model": "tiny", "prompt": PROMPT, "stream": False, "max_tokens": 4,
                        "temperature": 0.0,
                        "disaggregated_params": {"request_type": "context_only"}}


def test_the_context_answer_becomes_the_handoff_state() -> None:
    """The first token, its text, the cached tokens and the state verbatim; no page keys."""
    result = TrtllmPrefillDecode().prefill_result(request(), ctx_answer(), 0.25)
    assert (result.output_ids, result.text, result.finished) == ([42], " w42", False)
    assert (result.cached_tokens, result.handoff_keys, result.seconds) == (3, [], 0.25)
    assert result.engine_state == CTX_PARAMS
    length = TrtllmPrefillDecode().prefill_result(request(max_tokens=1), ctx_answer("length"), 0)
    assert length.finished is False  # trtllm-serve's own server still runs the generation leg


def test_a_context_answer_that_finished_needs_no_state() -> None:
    """finish_reason stop: the first token ended it (the state may be gone)."""
    result = TrtllmPrefillDecode().prefill_result(request(), ctx_answer("stop", None), 0)
    assert (result.finished, result.finish_reason, result.engine_state) == (True, "stop", {})


@pytest.mark.parametrize("params", [None, {"request_type": "generation_only"}, "x"])
def test_an_unfinished_context_answer_without_state_is_refused(params: Any) -> None:
    """Without context_only state the decode engine could not fetch the KV: a clear error."""
    with pytest.raises(ValueError, match="cache_transceiver_config"):
        TrtllmPrefillDecode().prefill_result(request(), ctx_answer(params=params), 0)
    with pytest.raises(ValueError, match="without choices"):
        TrtllmPrefillDecode().prefill_result(request(), {"object": "error"}, 0)


def test_the_decode_leg_echoes_the_state_as_generation_only() -> None:
    """The same request, streamed with usage, and the context's state verbatim (ctx_dp_rank
    included: the generation engine fetches from that attention-DP rank)."""
    pd = TrtllmPrefillDecode()
    prefill = pd.prefill_result(request(), ctx_answer(), 0)
    leg = pd.decode_request(request(dp_rank=0), prefill)
    assert (leg.path, leg.stream, dict(leg.headers)) == ("/v1/completions", True, {})
    assert leg.body == {
        "model": "tiny", "prompt": PROMPT, "stream": True, "max_tokens": 4, "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "disaggregated_params": {**CTX_PARAMS, "request_type": "generation_only"},
    }


def reference_signature(key: str, endpoint: str | None, opaque: str | None) -> str:
    """serve/disagg_auth.py's signature, from its description: HMAC-SHA256 of the compact,
    key-sorted JSON of the two transfer fields."""
    endpoint_json = "null" if endpoint is None else f'"{endpoint}"'
    opaque_json = "null" if opaque is None else f'"{opaque}"'
    payload = f'{{"ctx_info_endpoint":{endpoint_json},"encoded_opaque_state":{opaque_json}}}'
    payload_bytes = payload.encode()
    return "sha256=" + hmac.new(key.encode(), payload_bytes, hashlib.sha256).hexdigest()


def test_with_the_internal_key_the_decode_leg_is_signed() -> None:
    """x-trtllm-disagg-auth covers ctx_info_endpoint and encoded_opaque_state."""
    pd = TrtllmPrefillDecode("k3y")
    leg = pd.decode_request(request(), pd.prefill_result(request(), ctx_answer(), 0))
    assert dict(leg.headers) == {AUTH_HEADER: reference_signature(
        "k3y", "tcp://10.0.0.1:5000", "b3BhcXVlLXN0YXRl")}
    listed = {"ctx_info_endpoint": ["tcp://a:1", "tcp://b:2"], "encoded_opaque_state": None}
    assert auth_header("k3y", listed) == reference_signature("k3y", "tcp://a:1", None)
    bare = {**CTX_PARAMS, "encoded_opaque_state": None, "ctx_info_endpoint": None}
    leg = pd.decode_request(request(), pd.prefill_result(request(), ctx_answer(params=bare), 0))
    assert dict(leg.headers) == {}  # nothing protected: nothing to sign


async def test_a_streamed_answer_is_the_decode_stream_with_the_prompts_cached_tokens() -> None:
    """Chunks pass as they are (the first token is the decode engine's first chunk); usage
    says what the prefill engine found cached; the first object sends nothing early."""
    pd = TrtllmPrefillDecode()
    req = request(stream=True, include_usage=True)
    prefill = pd.prefill_result(req, ctx_answer(), 0)
    translator = TrtllmResponseTranslator(req, created=1)
    assert translator.chunk(pd.first_object(req, prefill)) == []
    stitched = [o async for o in pd.stitched(req, prefill, chunk(" w42"),
                                             objects(chunk(" w7", "length"), usage_chunk(2)))]
    assert stitched[:2] == [chunk(" w42"), chunk(" w7", "length")]
    assert stitched[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    out = [c for o in stitched for c in translator.chunk(o)] + translator.finish()
    assert "".join(c["choices"][0]["text"] for c in out if c["choices"]) == " w42 w7"
    assert out[-1]["usage"]["completion_tokens"] == 2


async def test_an_unstreamed_answer_is_one_object_with_the_whole_text() -> None:
    pd = TrtllmPrefillDecode()
    req = request()
    prefill = pd.prefill_result(req, ctx_answer(), 0)
    (whole,) = [o async for o in pd.stitched(req, prefill, chunk(" w42"),
                                             objects(chunk(" w7", "length"), usage_chunk(2)))]
    answer = TrtllmResponseTranslator(req, created=1).response(whole)
    assert answer["choices"][0]["text"] == " w42 w7"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 2
    (counted,) = [o async for o in pd.stitched(req, prefill, chunk(" w42"),
                                               objects(chunk(" w7", "length")))]
    assert counted["usage"]["completion_tokens"] == 2  # no usage chunk: counted pieces


def test_a_finished_prefill_is_the_whole_answer() -> None:
    pd = TrtllmPrefillDecode()
    req = request()
    prefill = pd.prefill_result(req, ctx_answer("stop", None), 0)
    answer = TrtllmResponseTranslator(req, created=1).response(pd.first_object(req, prefill))
    assert answer["choices"][0]["text"] == " w42"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["prompt_tokens"] == 5


def test_the_engines_move_the_kv_themselves() -> None:
    """No page keys to pull, no bootstrap server; a server error of the decode engine is a
    failed transfer, a client error is not."""
    pd = TrtllmPrefillDecode()
    assert pd.store_keys("tiny", ["anything"]) == []
    assert pd.bootstrap_address("http://h:8000", 9) is None
    assert [pd.import_failed(s) for s in (400, 409, 500, 503)] == [False, False, True, True]


def test_requests_for_the_engines_openai_parsing_are_not_split() -> None:
    openai = EngineOpenAI("/v1/chat/completions", {"model": "tiny", "messages": []})
    with pytest.raises(ValueError, match="aggregated"):
        TrtllmPrefillDecode().prefill_request(request(openai=openai))


def test_the_aggregated_body_names_no_rank() -> None:
    """trtllm-serve's OpenAI routes take no attention-DP rank: a placed rank is not sent."""
    body = to_completions_request(request(dp_rank=1, handoff=None)).body
    assert "dp_rank" not in str(body) and "attention_dp_rank" not in body


def test_the_adapter_offers_prefill_decode_with_its_key() -> None:
    cfg = AdapterConfig(EngineKind.TRTLLM, "http://h", "w", "m", block_size=16)
    signed = TrtllmAdapter(cfg, environ={AUTH_KEY_ENV: "k"})
    plain = TrtllmAdapter(cfg, environ={})
    assert isinstance(signed.pd, TrtllmPrefillDecode) and isinstance(plain.pd,
                                                                     TrtllmPrefillDecode)
    prefill = plain.pd.prefill_result(request(), ctx_answer(), 0)
    assert AUTH_HEADER in signed.pd.decode_request(request(), prefill).headers
    assert AUTH_HEADER not in plain.pd.decode_request(request(), prefill).headers
