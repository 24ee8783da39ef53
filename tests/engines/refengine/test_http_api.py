"""SGLang's HTTP surface on a real engine process: generate, OpenAI routes, info, errors."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from tests.support.polling import wait_until

pytestmark = pytest.mark.slow  # real processes, seconds a test


def test_generate_text_and_ids(h: Any, engine: Any) -> None:
    """/generate takes text or input_ids and returns text, output_ids and meta_info."""
    status, out = h.http(
        "POST",
        engine.url + "/generate",
        {"text": "the cache", "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    )
    assert status == 200
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5 and isinstance(out["text"], str)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 0
    assert meta["cached_tokens"] == 0
    status, again = h.http(
        "POST",
        engine.url + "/generate",
        {
            "input_ids": list(range(1, 40)),
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        },
    )
    assert status == 200 and again["meta_info"]["prompt_tokens"] == 39


def test_streaming_is_cumulative_and_ends_with_done(h: Any, engine: Any) -> None:
    """SSE chunks carry the growing output, a finish_reason only at the end, then [DONE]."""
    chunks = h.sse(
        engine.url + "/generate",
        {
            "input_ids": [5, 6, 7],
            "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    )
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    assert [len(c["output_ids"]) for c in data] == [1, 2, 3, 4]
    assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_prefix_hit_reports_cached_tokens(h: Any, engine: Any) -> None:
    """A repeated prompt reports its cached tokens in meta_info and OpenAI usage."""
    prompt = list(range(100, 180))
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = h.http("POST", engine.url + "/v1/completions", body)[1]
    second = h.http("POST", engine.url + "/v1/completions", body)[1]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert second["object"] == "text_completion"


def test_chat_completions_stream(h: Any, engine: Any) -> None:
    """Chat streaming: a role delta, content deltas, a finish chunk, usage, [DONE]."""
    chunks = h.sse(
        engine.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "explain the cache"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-2]["usage"]
    assert usage["completion_tokens"] == 4 and "cached_tokens" in usage["prompt_tokens_details"]
    status, full = h.http(
        "POST",
        engine.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "explain the cache"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-2])
    assert status == 200 and full["choices"][0]["message"]["content"] == text


def test_server_info_advertises_events_and_capacity(h: Any, engine: Any) -> None:
    """/server_info has page size, capacity and the kv_events block with bound ports."""
    status, info = h.http("GET", engine.url + "/server_info")
    assert status == 200
    assert info["page_size"] == 16 and info["max_total_num_tokens"] == 4096
    kv = info["kv_events"]
    assert kv["block_size"] == 16 and kv["topic"] == "kv-events" and kv["dp_size"] == 1
    assert kv["endpoint_port_base"] == int(engine.ready[0]["kv_events_endpoint"].rsplit(":")[-1])
    assert kv["replay_endpoint_port_base"] > 0
    assert info["internal_states"][0]["max_total_num_tokens"] == 4096


def test_loads_and_metrics(h: Any, engine: Any) -> None:
    """/v1/loads returns LoadSnapshot core keys; /metrics is Prometheus text."""
    status, loads = h.http("GET", engine.url + "/v1/loads")
    assert status == 200
    (load,) = loads["loads"]
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "token_usage",
        "max_total_num_tokens",
        "num_waiting_uncached_tokens",
        "cache_hit_rate",
    ):
        assert key in load
    assert h.http("GET", engine.url + "/v1/loads?dp_rank=3")[0] == 400
    status, text = h.http("GET", engine.url + "/metrics")
    assert status == 200 and "sglang:num_running_reqs" in text


def test_malformed_requests_get_sglang_errors(h: Any, engine: Any) -> None:
    """Bad bodies get 400 with SGLang's error shapes; nothing else is disturbed."""
    status, out = h.http("POST", engine.url + "/generate", b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]["message"]
    status, out = h.http("POST", engine.url + "/generate", {"sampling_params": {}})
    assert status == 400 and "Either text or input_ids" in out["error"]["message"]
    status, out = h.http(
        "POST",
        engine.url + "/generate",
        {"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 1}},
    )
    assert status == 400 and "max-total-tokens" in out["error"]["message"]
    status, out = h.http("POST", engine.url + "/v1/completions", {"prompt": 3})
    assert status == 400 and out["object"] == "error" and out["code"] == 400
    assert out["type"] == "BadRequestError"
    status, out = h.http("POST", engine.url + "/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages" in out["message"]


def test_fields_it_cannot_honour_are_refused_by_name(h: Any, engine: Any) -> None:
    """Tools, structured output, reasoning and LoRA adapters get a 400 naming the field, never
    a reply that silently ignored them; chat_template_kwargs reach the template."""
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, needle in [
        ({"tools": [tool]}, "tools are not supported"),
        ({"tool_choice": "required"}, "tools are not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object'"),
        ({"regex": "a|b"}, "regex is not supported"),
        ({"ebnf": 'root ::= "a"'}, "ebnf is not supported"),
        ({"reasoning_effort": "high"}, "reasoning is not supported"),
        ({"model": "tiny:adapter"}, "LoRA adapters are not supported"),
        ({"lora_path": "adapter"}, "LoRA adapters are not supported"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs must be an object"),
    ]:
        status, out = h.http("POST", engine.url + "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and needle in out["message"], (extra, out)
    for extra in [{"tool_choice": "none"}, {"response_format": {"type": "text"}},
                  {"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": True}}]:
        status, out = h.http("POST", engine.url + "/v1/chat/completions", {**chat, **extra})
        assert status == 200, (extra, out)


def test_bad_input_loses_nothing_in_flight(h: Any, engine: Any) -> None:
    """A long request completes normally while malformed requests are rejected beside it."""
    result: dict[str, object] = {}

    def long_request() -> None:
        result["out"] = h.http(
            "POST",
            engine.url + "/generate",
            {
                "input_ids": list(range(3, 300)),
                "sampling_params": {"max_new_tokens": 40, "temperature": 0},
            },
        )

    t = threading.Thread(target=long_request)
    t.start()
    for _ in range(5):
        assert h.http("POST", engine.url + "/generate", {"input_ids": ["x"]})[0] == 400
    t.join(timeout=60)
    status, out = result["out"]  # type: ignore[misc]
    assert status == 200 and out["meta_info"]["completion_tokens"] == 40


def test_abort_request_ends_a_stream(h: Any, engine: Any) -> None:
    """/abort_request with a rid ends that request with finish_reason abort."""
    chunks: list[object] = []

    def stream() -> None:
        chunks.extend(
            h.sse(
                engine.url + "/generate",
                {
                    "input_ids": [9, 9, 9],
                    "rid": "to-abort",
                    "stream": True,
                    "sampling_params": {
                        "max_new_tokens": 2000,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                },
            )
        )

    t = threading.Thread(target=stream)
    t.start()
    while True:  # poll until the request is running, then abort it
        load = h.http("GET", engine.url + "/v1/loads")[1]["loads"][0]
        if load["num_running_reqs"]:
            break
    assert h.http("POST", engine.url + "/abort_request", {"rid": "to-abort"})[0] == 200
    t.join(timeout=60)
    assert chunks[-1] == "[DONE]"
    last = chunks[-2]
    assert isinstance(last, dict) and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 2000


def test_flush_cache_empties_the_prefix_cache(h: Any, engine: Any) -> None:
    """/flush_cache succeeds when idle and the next repeat prompt is a miss."""
    body = {"input_ids": list(range(200, 240)), "sampling_params": {"max_new_tokens": 1}}
    h.http("POST", engine.url + "/generate", body)
    assert h.http("POST", engine.url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 32
    status, text = h.http("POST", engine.url + "/flush_cache")
    assert status == 200 and "Cache flushed" in text
    assert h.http("POST", engine.url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 0


def test_client_disconnect_aborts_the_request(h: Any, engine: Any) -> None:
    """A client that hangs up mid-stream frees its slot: the engine aborts the request."""
    import socket
    from urllib.parse import urlparse

    def generated() -> int:
        text = h.http("GET", engine.url + "/metrics")[1]
        line = next(x for x in text.splitlines() if x.startswith("sglang:generation_tokens_total"))
        return int(line.split()[1])

    before = generated()
    url = urlparse(engine.url)
    body = json.dumps(
        {
            "input_ids": [4, 4, 4],
            "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        }
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = b""
        while b"data: " not in seen:  # streaming has started (recv has the socket timeout)
            chunk = sock.recv(65536)
            assert chunk, "the server closed the stream"
            seen += chunk
    wait_until(
        lambda: not h.http("GET", engine.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"],
        "the engine to abort the request of a client that left", timeout_s=30,
    )
    assert generated() - before < 4000  # it was aborted, not run to its end


def test_sigterm_shuts_down_cleanly(h: Any) -> None:
    """SIGTERM stops the engine with exit status 0 after logging shutdown_finished."""
    proc = h.start("--compute", "sim", "--speedup", "50")
    proc.proc.terminate()
    assert proc.proc.wait(timeout=30) == 0
    assert "shutdown_finished" in proc.log_path.read_text()
