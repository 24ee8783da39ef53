"""One request to an engine's HTTP server, as every adapter makes it: the engine's API key,
the configured timeout, and every failure an ``AdapterError`` that says what was asked."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from adapters.base import AdapterConfig, AdapterError

__all__ = ["NotServedError", "engine_call"]

_NAMES = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm": "vLLM"}


class NotServedError(AdapterError):
    """The engine has no such route (404: an older release, or a feature left off)."""


async def engine_call(
    config: AdapterConfig, method: str, path: str, body: dict[str, Any] | None = None,
    *, json: bool = True,
) -> Any:
    """The engine's answer to ``method path``: parsed JSON, or the text with ``json=False``."""
    url = config.engine_url.rstrip("/") + path
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, headers=config.engine_headers()) as session,
            session.request(method, url, json=body) as resp,
        ):
            if resp.status == 404:
                raise NotServedError(f"{method} {url} answered 404: no such route here")
            raw = await resp.read()
            if resp.status != 200:
                hint = " (the engine wants its API key)" if resp.status == 401 else ""
                raise AdapterError(
                    f"{method} {url} answered {resp.status}{hint}: {raw[:200]!r}"
                )
    except (aiohttp.ClientError, TimeoutError) as exc:
        name = _NAMES.get(config.engine.value, config.engine.value)
        raise AdapterError(f"cannot reach {name} at {url}: {exc!r}") from exc
    if not json:
        return raw.decode("utf-8", "replace")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AdapterError(f"{method} {url} did not answer JSON: {raw[:200]!r}") from exc
