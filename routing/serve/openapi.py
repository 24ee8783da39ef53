"""The gateway's HTTP surface as an OpenAPI 3.0 document, served at ``GET /openapi.json``.

It describes what clients send and what they get back: the two prompted OpenAI routes with the
request fields the gateway reads (others are allowed and forwarded, never dropped; ``model``
one of the names served now), the read routes, and every error status with OpenAI's error
shape. Fuzzers drive the gateway from it (``tests/integration/gateway/test_openapi_fuzz.py``,
schemathesis).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import orjson

__all__ = ["document", "openapi_json"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True},
                       "code": {"type": "string", "nullable": True}},
    }},
}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                         "maxItems": 4}]}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": _STOP,
    "seed": {"type": "integer"},
    "cache_salt": {"type": "string"},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                   "content": {"type": "string"}},
}
_CHAT = {"type": "object", "required": ["model", "messages"], "additionalProperties": True,
         "properties": {**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE,
                                                  "minItems": 1}}}
_COMPLETION = {"type": "object", "required": ["model", "prompt"], "additionalProperties": True,
               "properties": {**_SAMPLING, "prompt": {"oneOf": [
                   {"type": "string"},
                   {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                   {"type": "array", "items": {"type": "string"}, "minItems": 1},
                   {"type": "array", "minItems": 1, "items": {
                       "type": "array", "items": {"type": "integer", "minimum": 0},
                       "minItems": 1}},
               ]}}}
_ERRORS = {
    str(status): {"description": why, "content": {"application/json": {"schema": _ERROR}}}
    for status, why in (
        (400, "malformed body, bad parameter, over the context limit"),
        (401, "a missing or unknown API key (--api-key-file)"),
        (404, "unknown model (model_not_found), or no worker serves the route"),
        (413, "body over --max-body-bytes"),
        (429, "every worker busy, or the tenant over its rate (retry-after)"),
        (502, "every worker tried failed before answering"),
        (503, "no healthy worker, or a request waited past --queue-timeout-s"),
        (504, "the worker was silent past --upstream-timeout-s"),
    )
}


def _prompted(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the completion (SSE events when stream)"},
                      **_ERRORS},
    }}


def _read(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary,
                    "responses": {"200": {"description": summary, "content": {media: {}}},
                                  "503": {"description": "no routable worker (health only)"}}}}


def _model_read() -> dict[str, Any]:
    return {"get": {
        "summary": "one served model (OpenAI's model object)",
        "parameters": [{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model", "content": {"application/json": {}}},
                      "404": _ERRORS["404"]},
    }}


_U32_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295}}
_INDEX_QUERY = {  # Mooncake's RFC #1403 (docs/indexer-api.md); any other field is a 400
    "block_size": {"type": "integer", "minimum": 1},
    "lora_name": {"type": "string"},
    "tenant_id": {"type": "string"},
    "instance_id": {"type": "string"},
    "cache_salt": {"type": "string"},
}
_INDEX_ANSWER = {"description": "{tenant: {instance: {longest_matched, GPU, CPU, DISK, REMOTE, "
                 "DP: {rank: tokens}}}}, in tokens", "content": {"application/json": {}}}


def _index_query(summary: str, model: dict[str, Any], blocks: dict[str, Any],
                 required: str) -> dict[str, Any]:
    schema = {"type": "object", "additionalProperties": False,
              "required": ["model", "block_size", required],
              "properties": {"model": model, **_INDEX_QUERY, **blocks}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": _INDEX_ANSWER, **{
            str(status): {"description": why, "content": {"application/json": {
                "schema": _ERROR}}}
            for status, why in (
                (400, "malformed body, an unknown field, a block size or hash scheme not "
                      "this index's"),
                (401, "a missing or unknown API key (--api-key-file)"),
                (403, "a tenant_id other than the API key's tenant"),
                (404, "unknown model (model_not_found) or instance (instance_not_found)"),
                (413, "body over --max-body-bytes"))}},
    }}


def document(model_names: Sequence[str] = ()) -> dict[str, Any]:
    """The document; ``model_names``: the names clients may ask for (empty: any string)."""
    model: dict[str, Any] = {"type": "string"}
    if model_names:
        model["enum"] = list(model_names)
    chat = {**_CHAT, "properties": {**_CHAT["properties"], "model": model}}  # type: ignore[dict-item]
    completion = {**_COMPLETION, "properties": {**_COMPLETION["properties"],  # type: ignore[dict-item]
                                                "model": model}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvsidecar gateway", "version": "1"},
        "paths": {
            "/v1/chat/completions": _prompted("OpenAI chat completions, placed by KV prefix",
                                              chat),
            "/v1/completions": _prompted("OpenAI completions, placed by KV prefix", completion),
            "/v1/models": _read("the served models"),
            "/v1/models/{model}": _model_read(),
            "/v1/workers": _read("the workers, their state and placement figures"),
            "/health": _read("200 while some worker is routable"),
            "/metrics": _read("Prometheus metrics", "text/plain"),
            "/openapi.json": _read("this document"),
            "/query": _index_query("KV indexer API: what each instance holds of these tokens",
                                   model, {"token_ids": _U32_LIST}, "token_ids"),
            "/query_by_hash": _index_query(
                "KV indexer API: what each instance holds of these block hashes (the RFC's "
                "XXH3-64 rolling hashes with the gateway's --xxh3-seed, or ours: hash_scheme "
                "kvsidecar-v1)", model,
                {"seq_hashes": {"type": "array", "items": {"type": "integer"}},
                 "hash_scheme": {"type": "string", "enum": ["xxh3-64", "kvsidecar-v1"]},
                 "hash_seed": {"type": "integer", "minimum": 0}}, "seq_hashes"),
        },
    }


@lru_cache(maxsize=8)
def openapi_json(model_names: tuple[str, ...]) -> bytes:
    return orjson.dumps(document(model_names))
