"""Request parsing and response rendering for SGLang's native API (``GenerateReqInput`` in
``sglang/srt/managers/io_struct.py``, ``meta_info`` as ``tokenizer_manager.py`` builds it).

Everything the client sends is validated here and turned into :class:`Request` objects; a bad
field raises :class:`BadRequest` naming the field, what was received and what was expected.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from refengine.request import Request, SamplingParams
from refengine.tokenizer import ChatTokenizer

__all__ = ["BadRequest", "GenerateInput", "meta_info", "parse_generate", "parse_sampling"]

# SGLang sampling keys we accept without acting on them (neutral at their defaults here).
_IGNORED_SAMPLING = {
    "min_p",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "custom_params",
}
_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
}
_GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "cache_salt",
    "return_logprob",
    "lora_path",
    "extra_key",
    "priority",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "data_parallel_rank",
    "routed_dp_rank",
    "session_params",
    "custom_logit_processor",
    "return_text_in_logprobs",
    "top_logprobs_num",
    "logprob_start_len",
    "kv_transfer",
}


class BadRequest(ValueError):
    """Client error (HTTP 400 unless ``status`` says otherwise)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling(raw: Any, vocab_size: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = set(raw) - _SAMPLING - _IGNORED_SAMPLING
    if unknown:
        raise BadRequest(f"unknown sampling_params keys: {sorted(unknown)}")
    if raw.get("n", 1) != 1:
        raise BadRequest("sampling_params.n must be 1 (parallel sampling is not supported)")
    stop = raw.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}")
    stop_ids = raw.get("stop_token_ids") or ()
    if not isinstance(stop_ids, list | tuple):
        raise BadRequest(f"stop_token_ids must be a list of integers, got {stop_ids!r}")
    seed = raw.get("sampling_seed", raw.get("seed"))
    try:
        return SamplingParams(
            max_new_tokens=_int("max_new_tokens", raw.get("max_new_tokens", 128), 0),
            temperature=_float("temperature", raw.get("temperature", 1.0)),
            top_p=_float("top_p", raw.get("top_p", 1.0)),
            top_k=_int("top_k", raw.get("top_k", -1)),
            min_new_tokens=_int("min_new_tokens", raw.get("min_new_tokens", 0), 0),
            stop=tuple(stop),
            stop_token_ids=tuple(_int("stop_token_ids[]", t, 0) for t in stop_ids),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            seed=None if seed is None else _int("sampling_seed", seed),
            presence_penalty=_float("presence_penalty", raw.get("presence_penalty", 0.0)),
            frequency_penalty=_float("frequency_penalty", raw.get("frequency_penalty", 0.0)),
            repetition_penalty=_float("repetition_penalty", raw.get("repetition_penalty", 1.0)),
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def check_ids(ids: Any, vocab_size: int, name: str = "input_ids") -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{name} must hold integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"token id {t} in {name} is outside the vocabulary [0, {vocab_size})")
    return ids


@dataclass(frozen=True, slots=True)
class GenerateInput:
    requests: list[Request]
    texts_given: bool
    batch: bool
    stream: bool


def parse_generate(body: Any, tok: ChatTokenizer) -> GenerateInput:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = set(body) - _GENERATE_KEYS
    if unknown:
        raise BadRequest(f"unknown fields: {sorted(unknown)}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if body.get("return_logprob"):
        raise BadRequest("return_logprob is not supported by the reference engine")
    if body.get("lora_path"):
        raise BadRequest("LoRA adapters are not supported by the reference engine")
    stream = bool(body.get("stream", False))
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(f"cache_salt must be a string, got {salt!r}")
    batch = isinstance(text, list) or (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    )
    if text is not None:
        items = text if isinstance(text, list) else [text]
        if not items or not all(isinstance(t, str) and t for t in items):
            raise BadRequest("text must be a non-empty string or a list of them")
        prompts = [tok.encode(t) for t in items]
        if not all(prompts):
            raise BadRequest("text encodes to zero tokens")
    else:
        id_items: list[Any] = ids if batch and isinstance(ids, list) else [ids]
        prompts = [check_ids(p, tok.vocab_size) for p in id_items]
    if batch and stream:
        raise BadRequest("streaming a batch of prompts is not supported; send them one by one")
    raw_sp = body.get("sampling_params")
    sps = raw_sp if isinstance(raw_sp, list) else [raw_sp] * len(prompts)
    if len(sps) != len(prompts):
        raise BadRequest("sampling_params list length must match the batch size")
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts):
        raise BadRequest("rid list length must match the batch size")
    reqs = []
    for i, (prompt, sp) in enumerate(zip(prompts, sps, strict=True)):
        r = rids[i]
        if r is not None and not isinstance(r, str):
            raise BadRequest(f"rid must be a string, got {r!r}")
        rid_i = r if (r and not batch) or (r and isinstance(rid, list)) else uuid.uuid4().hex
        reqs.append(Request(rid_i, list(prompt), parse_sampling(sp, tok.vocab_size), salt))
    return GenerateInput(reqs, text is not None, batch, stream)


def meta_info(req: Request, started: float) -> dict[str, Any]:
    """SGLang's ``meta_info``: ids, token counts, cache breakdown, finish reason."""
    out: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish.to_json() if req.finish else None,
        "prompt_tokens": len(req.prompt),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
    }
    if req.cached_tokens:
        out["cached_tokens_details"] = {
            "device": req.cached_tokens_device,
            "host": 0,
            "storage": req.cached_tokens_storage,
        }
    if req.finish is not None:
        out["e2e_latency"] = round(time.monotonic() - started, 6)
    return out
