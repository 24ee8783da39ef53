"""The KV indexer API's four requests (Mooncake's RFC #1403, ``docs/indexer-api.md``), parsed.

``POST /register``, ``/unregister``, ``/query`` and ``/query_by_hash`` take JSON objects whose
field names are the RFC's (``modelname`` on the registration routes, ``model`` on the query
routes, as the RFC spells them). Every field is either read or refused: an unknown field, a
field of the wrong type, a deprecated one we cannot honour (``lora_id``) is a 400 in the
OpenAI error shape naming it (``param``) and saying what is accepted, never dropped.

Pure: bytes in, frozen dataclasses or ``OpenAIError`` out. What a query means for our index
(namespace, tenant, instances) is the caller's (``routing.serve.indexer_routes``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvcore.errors import OpenAIError

__all__ = [
    "DEFAULT_TENANT",
    "UNSUPPORTED_HASH_SCHEME",
    "HashScheme",
    "IndexQuery",
    "Registration",
    "Unregistration",
    "parse_query",
    "parse_query_by_hash",
    "parse_register",
    "parse_unregister",
]

DEFAULT_TENANT = "default"  # the RFC's default ``tenant_id``
UNSUPPORTED_HASH_SCHEME = "unsupported_hash_scheme"
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_MAX_BLOCK_SIZE = 4096  # kvcore.hashing.BlockHasher's bound


class HashScheme(enum.StrEnum):
    """What the numbers of ``/query_by_hash`` are (``hash_scheme``, our extension)."""

    # The RFC's, and the default: XXH3-64 rolling sequence hashes over little-endian u32
    # tokens, with a seed (``hash_seed``) the index was started with (``rolling_hashes``).
    XXH3_64 = "xxh3-64"
    # Ours (kvcore/hashing.py): chained under the namespace seed (model, LoRA, salt).
    KVSIDECAR_V1 = "kvsidecar-v1"


_REGISTER_FIELDS = ("endpoint", "replay_endpoint", "type", "modelname", "lora_name",
                    "tenant_id", "instance_id", "block_size", "dp_rank", "additionalsalt",
                    "hash_seed")
_UNREGISTER_FIELDS = ("type", "modelname", "lora_name", "tenant_id", "instance_id",
                      "block_size", "dp_rank")
_QUERY_COMMON = ("model", "lora_name", "lora_id", "tenant_id", "instance_id", "block_size",
                 "cache_salt")
_QUERY_FIELDS = (*_QUERY_COMMON, "token_ids")
_QUERY_BY_HASH_FIELDS = (*_QUERY_COMMON, "seq_hashes", "block_hash", "hash_scheme",
                         "hash_seed")


@dataclass(frozen=True, slots=True)
class Registration:
    """``POST /register``: a KV event publisher to follow, as one instance's DP rank."""

    endpoint: str
    type: str
    modelname: str
    instance_id: str
    block_size: int
    dp_rank: int
    replay_endpoint: str | None = None
    lora_name: str | None = None
    tenant_id: str = DEFAULT_TENANT
    additionalsalt: str | None = None
    hash_seed: int | None = None  # the XXH3 seed the client will query with (our extension)


@dataclass(frozen=True, slots=True)
class Unregistration:
    """``POST /unregister``: stop following ``(instance_id, tenant_id, dp_rank)``."""

    type: str
    modelname: str
    instance_id: str
    block_size: int
    dp_rank: int
    lora_name: str | None = None
    tenant_id: str = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class IndexQuery:
    """``POST /query`` (``token_ids``) or ``/query_by_hash`` (``seq_hashes``): who holds how
    much of this prefix. ``tenant_id`` None: the RFC's default (the caller decides what that
    is: ``default``, or the tenant of the caller's API key)."""

    model: str
    block_size: int
    token_ids: list[int] | None = None
    seq_hashes: list[int] | None = None
    hash_scheme: HashScheme | None = None
    hash_seed: int | None = None  # XXH3_64 only: the seed the client hashed with
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


class _Fields:
    """One request's JSON object, read field by field; anything not read is refused."""

    def __init__(self, body: bytes, route: str, allowed: tuple[str, ...]) -> None:
        self.route = route
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _bad(f"{route} takes a JSON object: the body is not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise _bad(f"{route} takes a JSON object, not {type(obj).__name__}")
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise _bad(f"{route}: unknown field(s) {unknown}; the fields it takes are "
                       f"{list(allowed)}", param=unknown[0])
        self.obj: Mapping[str, Any] = obj

    def text(self, name: str) -> str | None:
        """An optional string: null, absent or empty is None."""
        value = self.obj.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise _bad(f"{self.route}: '{name}' must be a string, got {_kind(value)}", name)
        return value or None

    def required_text(self, name: str) -> str:
        value = self.text(name)
        if value is None:
            raise _bad(f"{self.route}: '{name}' is required (a non-empty string)", name)
        return value

    def integer(self, name: str, low: int, high: int) -> int:
        """A required integer in [low, high]."""
        value = self.obj.get(name)
        if type(value) is not int or not low <= value <= high:
            got = "nothing" if value is None else _shown(value)
            raise _bad(f"{self.route}: '{name}' is required, an integer in [{low}, {high}]; "
                       f"got {got}", name)
        return value

    def optional_integer(self, name: str, low: int, high: int) -> int | None:
        return None if self.obj.get(name) is None else self.integer(name, low, high)

    def integers(self, name: str, low: int, high: int) -> list[int] | None:
        value = self.obj.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise _bad(f"{self.route}: '{name}' must be an array of integers in "
                       f"[{low}, {high}], got {_kind(value)}", name)
        for i, v in enumerate(value):
            if type(v) is not int or not low <= v <= high:
                raise _bad(f"{self.route}: '{name}' must be an array of integers in "
                           f"[{low}, {high}]; {name}[{i}] is {_shown(v)}", name)
        return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    text = orjson.dumps(value).decode() if not isinstance(value, float) else repr(value)
    return text[:60]


def _tenant(fields: _Fields) -> str:
    return fields.text("tenant_id") or DEFAULT_TENANT


def parse_register(body: bytes) -> Registration:
    """``POST /register``'s body (required: endpoint, type, modelname, instance_id,
    block_size, dp_rank)."""
    f = _Fields(body, "POST /register", _REGISTER_FIELDS)
    return Registration(
        endpoint=f.required_text("endpoint"),
        type=f.required_text("type"),
        modelname=f.required_text("modelname"),
        instance_id=f.required_text("instance_id"),
        block_size=f.integer("block_size", 1, _MAX_BLOCK_SIZE),
        dp_rank=f.integer("dp_rank", 0, _U32),
        replay_endpoint=f.text("replay_endpoint"),
        lora_name=f.text("lora_name"),
        tenant_id=_tenant(f),
        additionalsalt=f.text("additionalsalt"),
        hash_seed=f.optional_integer("hash_seed", 0, _U64),
    )


def parse_unregister(body: bytes) -> Unregistration:
    """``POST /unregister``'s body: the registration's identity."""
    f = _Fields(body, "POST /unregister", _UNREGISTER_FIELDS)
    return Unregistration(
        type=f.required_text("type"),
        modelname=f.required_text("modelname"),
        instance_id=f.required_text("instance_id"),
        block_size=f.integer("block_size", 1, _MAX_BLOCK_SIZE),
        dp_rank=f.integer("dp_rank", 0, _U32),
        lora_name=f.text("lora_name"),
        tenant_id=_tenant(f),
    )


def _query_fields(f: _Fields) -> dict[str, Any]:
    if f.obj.get("lora_id") is not None:
        raise _bad(f"{f.route}: 'lora_id' is deprecated by the RFC and not kept by this index "
                   "(adapters are named, not numbered); send 'lora_name'", "lora_id")
    return {
        "model": f.required_text("model"),
        "block_size": f.integer("block_size", 1, _MAX_BLOCK_SIZE),
        "lora_name": f.text("lora_name"),
        "tenant_id": f.text("tenant_id"),
        "instance_id": f.text("instance_id"),
        "cache_salt": f.text("cache_salt"),
    }


def parse_query(body: bytes) -> IndexQuery:
    """``POST /query``'s body (required: model, token_ids, block_size)."""
    f = _Fields(body, "POST /query", _QUERY_FIELDS)
    common = _query_fields(f)
    tokens = f.integers("token_ids", 0, _U32)
    if tokens is None:
        raise _bad("POST /query: 'token_ids' is required (an array of token ids)", "token_ids")
    return IndexQuery(token_ids=tokens, **common)


def parse_query_by_hash(body: bytes) -> IndexQuery:
    """``POST /query_by_hash``'s body (required: model, seq_hashes or its older name
    block_hash, block_size). ``hash_scheme`` (our extension) says whose hashes they are: the
    RFC's ``xxh3-64`` when omitted, with an optional ``hash_seed`` the answering index checks
    against its own; or ours, ``kvsidecar-v1``.

    Hashes are u64; a negative i64 is taken as the u64 with the same bits (clients whose JSON
    stops at i64 send them so, as Dynamo's indexer reads them)."""
    route = "POST /query_by_hash"
    f = _Fields(body, route, _QUERY_BY_HASH_FIELDS)
    common = _query_fields(f)
    seq = f.integers("seq_hashes", _I64_MIN, _U64)
    legacy = f.integers("block_hash", _I64_MIN, _U64)
    if seq is not None and legacy is not None:
        raise _bad(f"{route}: send 'seq_hashes' or its older name 'block_hash', not both",
                   "block_hash")
    hashes = seq if seq is not None else legacy
    if hashes is None:
        raise _bad(f"{route}: 'seq_hashes' is required (an array of u64 block hashes)",
                   "seq_hashes")
    raw_scheme = f.text("hash_scheme")
    scheme = HashScheme.XXH3_64
    if raw_scheme is not None:
        try:
            scheme = HashScheme(raw_scheme)
        except ValueError:
            raise _bad(f"{route}: unknown 'hash_scheme' {raw_scheme!r}; known: "
                       f"{[s.value for s in HashScheme]} (the RFC's XXH3-64 rolling hashes "
                       "when omitted)", "hash_scheme", UNSUPPORTED_HASH_SCHEME) from None
    seed = f.optional_integer("hash_seed", 0, _U64)
    if seed is not None and scheme is not HashScheme.XXH3_64:
        raise _bad(f"{route}: 'hash_seed' is the seed of the xxh3-64 scheme; "
                   f"{scheme.value!r} hashes take none", "hash_seed")
    return IndexQuery(seq_hashes=[h & _U64 for h in hashes], hash_scheme=scheme,
                      hash_seed=seed, **common)
