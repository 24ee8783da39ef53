"""The indexer API's requests (Mooncake RFC #1403) parsed: the RFC's examples, and refusals."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvcore.errors import OpenAIError
from routing.indexer.requests import (
    UNSUPPORTED_HASH_SCHEME,
    HashScheme,
    IndexQuery,
    Registration,
    Unregistration,
    parse_query,
    parse_query_by_hash,
    parse_register,
    parse_unregister,
)

# The RFC's example bodies, verbatim (docs/source/design/conductor/indexer-api-design.md).
RFC_REGISTER = {
    "endpoint": "tcp://1.1.1.1:5557", "replay_endpoint": "tcp://1.1.1.1:5558", "type": "vLLM",
    "modelname": "deepseek", "lora_name": "sql-adapter", "tenant_id": "default",
    "instance_id": "vllm-prefill-node1", "block_size": 128, "dp_rank": 0,
    "additionalsalt": "w8a8",
}
RFC_UNREGISTER = {
    "type": "vLLM", "modelname": "deepseek", "lora_name": "sql-adapter", "tenant_id": "default",
    "instance_id": "vllm-prefill-node1", "block_size": 128, "dp_rank": 0,
}
RFC_QUERY = {
    "model": "deepseek", "lora_name": "sql-adapter", "token_ids": [101, 15, 100, 55, 89],
    "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 64,
    "cache_salt": "w8a8",
}
RFC_QUERY_BY_HASH = {
    "model": "deepseek", "lora_name": "sql-adapter", "seq_hashes": [1234567890, 9876543210],
    "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 64,
    "cache_salt": "w8a8",
}


def body(obj: Any) -> bytes:
    return orjson.dumps(obj)


def refusal(parse: Any, obj: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(obj if isinstance(obj, bytes) else body(obj))
    assert info.value.status == 400
    return info.value


def test_rfc_register_example_reads_every_field() -> None:
    """The RFC's /register example parses with every field kept."""
    assert parse_register(body(RFC_REGISTER)) == Registration(
        endpoint="tcp://1.1.1.1:5557", type="vLLM", modelname="deepseek",
        instance_id="vllm-prefill-node1", block_size=128, dp_rank=0,
        replay_endpoint="tcp://1.1.1.1:5558", lora_name="sql-adapter", tenant_id="default",
        additionalsalt="w8a8")


def test_rfc_unregister_example_reads_every_field() -> None:
    """The RFC's /unregister example parses with every field kept."""
    assert parse_unregister(body(RFC_UNREGISTER)) == Unregistration(
        type="vLLM", modelname="deepseek", instance_id="vllm-prefill-node1", block_size=128,
        dp_rank=0, lora_name="sql-adapter", tenant_id="default")


def test_rfc_query_example_reads_every_field() -> None:
    """The RFC's /query example parses with every field kept."""
    assert parse_query(body(RFC_QUERY)) == IndexQuery(
        model="deepseek", block_size=64, token_ids=[101, 15, 100, 55, 89],
        lora_name="sql-adapter", tenant_id="default", instance_id="vllm-prefill-node1",
        cache_salt="w8a8")


def test_optional_fields_default_as_the_rfc_says() -> None:
    """Omitted tenant_id is 'default' on registration, left to the caller on queries; an empty
    lora_name means the base model."""
    reg = {k: v for k, v in RFC_REGISTER.items()
           if k not in ("tenant_id", "replay_endpoint", "additionalsalt")}
    parsed = parse_register(body({**reg, "lora_name": ""}))
    assert (parsed.tenant_id, parsed.lora_name, parsed.replay_endpoint) == ("default", None, None)
    query = parse_query(body({"model": "m", "block_size": 16, "token_ids": []}))
    assert (query.tenant_id, query.instance_id, query.lora_name) == (None, None, None)


def test_rfc_query_by_hash_example_reads_every_field() -> None:
    """The RFC's /query_by_hash example parses as XXH3-64 rolling hashes (the RFC's scheme,
    no hash_scheme needed), every field kept; a hash_seed, when sent, is kept for the index
    to check."""
    assert parse_query_by_hash(body(RFC_QUERY_BY_HASH)) == IndexQuery(
        model="deepseek", block_size=64, seq_hashes=[1234567890, 9876543210],
        hash_scheme=HashScheme.XXH3_64, lora_name="sql-adapter", tenant_id="default",
        instance_id="vllm-prefill-node1", cache_salt="w8a8")
    q = parse_query_by_hash(body({**RFC_QUERY_BY_HASH, "hash_scheme": "xxh3-64",
                                  "hash_seed": 1337}))
    assert (q.hash_scheme, q.hash_seed) == (HashScheme.XXH3_64, 1337)
    assert parse_register(body({**RFC_REGISTER, "hash_seed": 7})).hash_seed == 7


def test_an_unknown_hash_scheme_is_refused_naming_those_taken() -> None:
    """Another scheme (vLLM's sha256, say) is a 400 unsupported_hash_scheme naming ours."""
    err = refusal(parse_query_by_hash, {**RFC_QUERY_BY_HASH, "hash_scheme": "sha256"})
    assert err.code == UNSUPPORTED_HASH_SCHEME and err.param == "hash_scheme"
    assert "kvsidecar-v1" in err.message and "xxh3-64" in err.message


def test_query_by_hash_in_our_scheme() -> None:
    """With hash_scheme kvsidecar-v1 the hashes are read as u64 (an i64 keeps its bits)."""
    q = parse_query_by_hash(body({**RFC_QUERY_BY_HASH, "hash_scheme": "kvsidecar-v1",
                                  "seq_hashes": [1, (1 << 64) - 1, -1]}))
    assert q.seq_hashes == [1, (1 << 64) - 1, (1 << 64) - 1]
    assert q.hash_scheme is HashScheme.KVSIDECAR_V1 and q.token_ids is None


def test_query_by_hash_takes_the_older_name_block_hash() -> None:
    """'block_hash' (the RFC's earlier name) is read like seq_hashes; both at once is refused."""
    legacy = {k: v for k, v in RFC_QUERY_BY_HASH.items() if k != "seq_hashes"}
    q = parse_query_by_hash(body({**legacy, "block_hash": [7], "hash_scheme": "kvsidecar-v1"}))
    assert q.seq_hashes == [7]
    err = refusal(parse_query_by_hash, {**RFC_QUERY_BY_HASH, "block_hash": [7],
                                        "hash_scheme": "kvsidecar-v1"})
    assert err.param == "block_hash"


@pytest.mark.parametrize(
    ("parse", "obj", "param"),
    [
        (parse_query, {**RFC_QUERY, "top_k": 3}, "top_k"),  # unknown field
        (parse_query, {**RFC_QUERY, "lora_id": 3}, "lora_id"),  # deprecated, not honoured
        (parse_query, {k: v for k, v in RFC_QUERY.items() if k != "token_ids"}, "token_ids"),
        (parse_query, {**RFC_QUERY, "token_ids": [1, -1]}, "token_ids"),
        (parse_query, {**RFC_QUERY, "token_ids": [1, 1 << 32]}, "token_ids"),
        (parse_query, {**RFC_QUERY, "token_ids": "1 2 3"}, "token_ids"),
        (parse_query, {**RFC_QUERY, "block_size": 0}, "block_size"),
        (parse_query, {**RFC_QUERY, "block_size": "64"}, "block_size"),
        (parse_query, {**RFC_QUERY, "block_size": True}, "block_size"),
        (parse_query, {k: v for k, v in RFC_QUERY.items() if k != "model"}, "model"),
        (parse_query, {**RFC_QUERY, "tenant_id": 5}, "tenant_id"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "hash_scheme": "sha256"}, "hash_scheme"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "hash_seed": -1}, "hash_seed"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "hash_seed": "1337"}, "hash_seed"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "hash_seed": 1,
                               "hash_scheme": "kvsidecar-v1"}, "hash_seed"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "seq_hashes": ["0x1f"]}, "seq_hashes"),
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "seq_hashes": 5}, "seq_hashes"),
        (parse_register, body({**RFC_REGISTER, "hash_seed": 1})
         .replace(b'"hash_seed":1', b'"hash_seed":18446744073709551616'), "hash_seed"),
        (parse_query_by_hash, body({**RFC_QUERY_BY_HASH, "hash_scheme": "kvsidecar-v1"})
         .replace(b"1234567890", b"18446744073709551616"), "seq_hashes"),  # 2**64
        (parse_query_by_hash, {**RFC_QUERY_BY_HASH, "seq_hashes": [1.5],
                               "hash_scheme": "kvsidecar-v1"}, "seq_hashes"),
        (parse_register, {k: v for k, v in RFC_REGISTER.items() if k != "dp_rank"}, "dp_rank"),
        (parse_register, {**RFC_REGISTER, "endpoint": ""}, "endpoint"),
        (parse_register, {**RFC_REGISTER, "model_name": "deepseek"}, "model_name"),
        (parse_unregister, {**RFC_UNREGISTER, "dp_rank": -1}, "dp_rank"),
    ],
)
def test_bad_fields_are_refused_by_name(parse: Any, obj: Any, param: str) -> None:
    """An unknown, missing, deprecated or mistyped field is a 400 naming it."""
    err = refusal(parse, obj)
    assert err.param == param, err.message
    assert param in err.message


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"query"', b"null"])
def test_a_body_that_is_no_json_object_is_refused(raw: bytes) -> None:
    """A body that is not a JSON object is a 400 saying so."""
    err = refusal(parse_query, raw)
    assert "JSON object" in err.message and err.to_dict()["error"]["type"] == \
        "invalid_request_error"
