"""A test-only stand-in for ``trtllm-serve`` in a disaggregated pair, speaking its published
OpenAI-side format (``serve/openai_protocol.py``, ``serve/disagg_auth.py``) and its V2 KV
cache events, with a toy model. Run as ``python -m tests.integration.disagg.trtllm_pd_standin
--role context|generation|aggregated ...``; it writes ``{"url": ...}`` to ``--ready-file``.

What it checks of every ``POST /v1/completions`` body, as trtllm-serve does: no field its
``CompletionRequest`` / ``DisaggregatedParams`` / ``StreamOptions`` do not name (their models
forbid extra fields: 400), a token-id prompt, and the request type its role serves:

* ``context``: ``disaggregated_params.request_type`` ``context_only``; answers the first
  token, not streamed, with ``choices[0].disaggregated_params`` (``first_gen_tokens``,
  ``ctx_request_id``, ``encoded_opaque_state``, ``ctx_dp_rank`` ...) and keeps the
  request's "KV" until the generation engine fetches it (``GET /_standin/kv/<id>``, once);
* ``generation``: ``generation_only`` with that state; fetches the KV from the context
  engine named in the opaque state (a failure is a 500 before any chunk, as a failed receive
  is) and answers the whole completion, the first token first;
* ``aggregated``: a plain completion, for the reference answer.

With ``--auth-key`` a leg carrying ``encoded_opaque_state`` or ``ctx_info_endpoint`` must
carry ``x-trtllm-disagg-auth``: ``sha256=`` + hex HMAC-SHA256 of those two fields as compact
JSON with sorted keys. The model: token ``t`` after ``ids`` is a fixed function of the last
ids, its text `` w<t>``. ``GET /_standin/requests`` returns every body received (and the
headers and state that matter); ``POST /kv_cache_events`` drains V2-format events
(``hash_algo`` ``v2_sha256``, hex block keys, ``layer_group_id`` 0) of the prompts it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import struct
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REQUEST_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user", "lora_request", "prompt_ignore_length", "use_beam_search",
    "top_k", "top_p_min", "min_p", "repetition_penalty", "length_penalty", "early_stopping",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "return_context_logits", "detokenize", "thinking_token_budget", "add_special_tokens",
    "response_format", "disaggregated_params", "priority", "conversation_params",
}
DISAGG_FIELDS = {
    "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits",
    "ctx_request_id", "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank",
    "ctx_info_endpoint", "schedule_style", "ctx_usage", "return_prompt_token_ids_b64",
    "resolved_thinking", "conversation_id",
}
STREAM_OPTION_FIELDS = {"include_usage", "continuous_usage_stats"}
AUTH_HEADER = "x-trtllm-disagg-auth"
PAGE = 16


class BadRequest(Exception):
    pass


def next_token(ids: list[int]) -> int:
    return (sum(ids[-4:]) * 31 + len(ids)) % 997 + 3


def generate(prompt: list[int], first: int | None, count: int) -> list[int]:
    out: list[int] = []
    while len(out) < count:
        out.append(first if first is not None and not out else next_token(prompt + out))
    return out


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def signature(key: str, params: dict[str, Any]) -> str:
    endpoint = params.get("ctx_info_endpoint")
    payload = json.dumps({"ctx_info_endpoint": endpoint,
                          "encoded_opaque_state": params.get("encoded_opaque_state")},
                         sort_keys=True, separators=(",", ":")).encode()
    return "sha256=" + hmac.new(key.encode(), payload, hashlib.sha256).hexdigest()


def error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return web.json_response({"object": "error", "message": message, "type": kind,
                              "param": None, "code": status}, status=status)


class Standin:
    def __init__(self, args: argparse.Namespace) -> None:
        self.role: str = args.role
        self.model: str = args.served_model_name
        self.auth_key: str | None = args.auth_key
        self.drop_kv: bool = args.drop_kv
        self.url = ""
        self.records: list[dict[str, Any]] = []
        self.kv: dict[int, list[int]] = {}  # ctx_request_id → prompt (context role)
        self.next_ctx_id = 1000
        self.blocks: set[bytes] = set()
        self.events: list[dict[str, Any]] = []
        self.next_event_id = 0
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.get("/health", lambda _: web.Response(text="")),
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/kv_cache_events", self.kv_events),
            web.get("/_standin/requests", lambda _: web.json_response(self.records)),
            web.get("/_standin/kv/{ctx_id}", self.fetch_kv),
        ])
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}]})

    async def kv_events(self, _: web.Request) -> web.Response:
        out, self.events = self.events, []
        return web.json_response(out)

    async def fetch_kv(self, request: web.Request) -> web.Response:
        prompt = self.kv.pop(int(request.match_info["ctx_id"]), None)
        if prompt is None:
            return error(404, "no such context request")
        return web.json_response({"prompt": prompt})

    # --- the request --------------------------------------------------------------------

    def check(self, body: Any) -> tuple[list[int], dict[str, Any] | None]:
        if not isinstance(body, dict):
            raise BadRequest("the body is not a JSON object")
        extra = set(body) - REQUEST_FIELDS
        if extra:
            raise BadRequest(f"Extra inputs are not permitted: {sorted(extra)}")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) for t in prompt):
            raise BadRequest("prompt must be a non-empty list of token ids")
        options = body.get("stream_options")
        if options is not None:
            if not body.get("stream"):
                raise BadRequest("Stream options can only be defined when stream is true.")
            if set(options) - STREAM_OPTION_FIELDS:
                raise BadRequest(f"Extra inputs are not permitted in stream_options: {options}")
        params = body.get("disaggregated_params")
        if params is not None and (set(params) - DISAGG_FIELDS or "request_type" not in params):
            raise BadRequest(f"bad disaggregated_params: {params}")
        return prompt, params

    def authenticate(self, request: web.Request, params: dict[str, Any]) -> None:
        protected = (params.get("encoded_opaque_state") is not None
                     or params.get("ctx_info_endpoint") is not None)
        if self.auth_key is None or not protected:
            return
        given = request.headers.get(AUTH_HEADER)
        if given is None or not hmac.compare_digest(given, signature(self.auth_key, params)):
            raise BadRequest("Invalid internal disaggregated request authentication")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record: dict[str, Any] = {"body": body, "auth": request.headers.get(AUTH_HEADER)}
        self.records.append(record)
        try:
            prompt, params = self.check(body)
            kind = None if params is None else params["request_type"]
            wanted = {"context": "context_only", "generation": "generation_only",
                      "aggregated": None}[self.role]
            if kind != wanted:
                raise BadRequest(f"this {self.role} server does not serve {kind!r} requests")
            if params is not None:
                self.authenticate(request, params)
        except BadRequest as exc:
            record["error"] = str(exc)
            return error(400, str(exc))
        cached = self.store(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        if self.role == "context":
            return self.context(prompt, max_tokens, cached, record)
        first = None
        if self.role == "generation":
            assert params is not None
            got = await self.receive_kv(params, prompt)
            if got is not None:
                record["error"] = got
                return error(500, got)
            first = int(params["first_gen_tokens"][0])
            cached = len(prompt)  # its KV arrived whole
        tokens = generate(prompt, first, max_tokens)
        if not body.get("stream"):
            return web.json_response(self.response(prompt, tokens, cached))
        return await self.stream(request, body, prompt, tokens, cached)

    def context(self, prompt: list[int], max_tokens: int, cached: int,
                record: dict[str, Any]) -> web.Response:
        ctx_id = self.next_ctx_id
        self.next_ctx_id += 1
        (first,) = generate(prompt, None, 1)
        if not self.drop_kv:
            self.kv[ctx_id] = prompt
        opaque = base64.b64encode(json.dumps({"ctx": self.url, "id": ctx_id}).encode()).decode()
        params = {"request_type": "context_only", "first_gen_tokens": [first],
                  "first_gen_log_probs": None, "first_gen_logits": None,
                  "ctx_request_id": ctx_id, "encoded_opaque_state": opaque, "draft_tokens": None,
                  "disagg_request_id": None, "ctx_dp_rank": 0, "ctx_info_endpoint": None,
                  "schedule_style": None, "ctx_usage": None}
        record["answered"] = params
        answer = self.response(prompt, [first], cached)
        answer["choices"][0]["finish_reason"] = "length" if max_tokens <= 1 else "not_finished"
        answer["choices"][0]["disaggregated_params"] = params
        return web.json_response(answer)

    async def receive_kv(self, params: dict[str, Any], prompt: list[int]) -> str | None:
        """The generation engine's KV receive: None when it arrived, else why not."""
        try:
            state = json.loads(base64.b64decode(params["encoded_opaque_state"]))
            assert self.session is not None
            async with self.session.get(f"{state['ctx']}/_standin/kv/{state['id']}") as r:
                if r.status != 200:
                    return f"KV cache transfer failed: context request {state['id']} is gone"
                got = await r.json()
        except (KeyError, TypeError, ValueError, aiohttp.ClientError) as exc:
            return f"KV cache transfer failed: {exc!r}"
        if params.get("ctx_request_id") != state["id"] or got["prompt"] != prompt:
            return "KV cache transfer failed: the context request is another prompt's"
        return None

    def response(self, prompt: list[int], tokens: list[int], cached: int) -> dict[str, Any]:
        return {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": text_of(tokens), "token_ids": None,
                             "logprobs": None, "finish_reason": "length", "stop_reason": None,
                             "disaggregated_params": None}],
                "usage": self.usage(prompt, len(tokens), cached), "prompt_token_ids": prompt}

    def usage(self, prompt: list[int], completion: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": len(prompt), "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def stream(self, request: web.Request, body: dict[str, Any], prompt: list[int],
                     tokens: list[int], cached: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        for i, token in enumerate(tokens):
            finish = "length" if i == len(tokens) - 1 else None
            await send({"id": "cmpl-standin", "object": "text_completion", "created": 0,
                        "model": self.model, "choices": [
                            {"index": 0, "text": text_of([token]), "token_ids": None,
                             "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                        "usage": None})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": "cmpl-standin", "object": "text_completion", "created": 0,
                        "model": self.model, "choices": [],
                        "usage": self.usage(prompt, len(tokens), cached)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def store(self, prompt: list[int]) -> int:
        """Hold the prompt's full pages (V2 events for the new ones); its cached tokens."""
        parent = hashlib.sha256(b"\x00").digest()
        cached, new, first_parent = 0, [], None
        for start in range(0, len(prompt) - len(prompt) % PAGE, PAGE):
            tokens = prompt[start : start + PAGE]
            key = hashlib.sha256(parent + struct.pack(f"<{PAGE}I", *tokens)).digest()
            if key in self.blocks and not new:
                cached += PAGE
            elif key not in self.blocks:
                self.blocks.add(key)
                new.append({"type": "stored_block", "block_hash": key.hex(),
                            "tokens": [{"type": "unique_token", "token_id": t,
                                        "token_extra_id": 0} for t in tokens],
                            "cache_level": 0, "priority": 35, "mm_keys": []})
                if len(new) == 1 and start:
                    first_parent = parent.hex()
            parent = key
        if new:
            self.events.append({"event_id": self.next_event_id, "window_size": 4096,
                                "hash_algo": "v2_sha256", "layer_group_id": 0,
                                "data": {"type": "stored", "parent_hash": first_parent,
                                         "blocks": new}})
            self.next_event_id += 1
        return cached


async def main() -> None:
    p = argparse.ArgumentParser(prog="trtllm_pd_standin", description=__doc__)
    p.add_argument("--role", choices=["context", "generation", "aggregated"], required=True)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--auth-key", help="internal_request_auth_key: check the decode leg's HMAC")
    p.add_argument("--drop-kv", action="store_true", help="lose every context's KV")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", required=True)
    args = p.parse_args()
    standin = Standin(args)
    runner = web.AppRunner(standin.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = next(a for a in runner.addresses if isinstance(a, tuple))[1]
    standin.url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        standin.session = session
        Path(args.ready_file).write_text(json.dumps({"url": standin.url}) + "\n")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
