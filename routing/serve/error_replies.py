"""The errors the gateway answers itself, before a request reaches the pipeline: no valid
API key (401), a proxied route called without POST (405), a route or model it does not
serve (404), a tenant over its rate limit (429).

Each says what was asked and what would have been accepted, in the OpenAI error shape
(``kvcore.errors``); ``Gateway.handle`` writes them in the route's dialect with the request
id. The pipeline's own refusals (busy workers, failed legs) are the exchange's
(``routing.pipeline.exchange``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.errors import (
    METHOD_NOT_ALLOWED,
    MODEL_NOT_FOUND,
    RATE_LIMIT_EXCEEDED,
    UNKNOWN_ENDPOINT,
    OpenAIError,
)
from routing.prompt.openai_api import Endpoint

__all__ = [
    "UNAUTHORIZED",
    "method_not_allowed",
    "model_not_found",
    "no_route",
    "rate_limited",
]

UNAUTHORIZED = OpenAIError(
    401,
    "a valid API key is required: send 'Authorization: Bearer <key>' (or 'x-api-key')",
    code="invalid_api_key",
)


def method_not_allowed(path: bytes, method: bytes) -> OpenAIError:
    """A proxied route called with another method than POST."""
    return OpenAIError(405, f"{path.decode()} takes POST, not {method.decode()}",
                       code=METHOD_NOT_ALLOWED)


def no_route(method: bytes, path: bytes) -> OpenAIError:
    """A route the gateway does not serve: the message lists those it does."""
    routes = ", ".join(e.value for e in Endpoint)
    return OpenAIError(
        404, f"no route for {method.decode()} {path.decode()}: this gateway serves POST "
        f"{routes}, the KV indexer API's POST /query and /query_by_hash, GET "
        "/v1/models[/<model>], /health, /metrics, /v1/workers and /openapi.json",
        code=UNKNOWN_ENDPOINT)


def model_not_found(name: str, names: Sequence[str]) -> OpenAIError:
    """``GET /v1/models/{model}`` of a model the gateway does not serve."""
    return OpenAIError(404, f"the model {name!r} does not exist; this gateway serves "
                       f"{list(names)}", param="model", code=MODEL_NOT_FOUND)


def rate_limited(tenant_name: str, wait_s: float) -> OpenAIError:
    """A tenant over its requests per second (``--rate-limit-rps``)."""
    return OpenAIError(
        429,
        f"tenant {tenant_name!r} is over its limit of requests per second; retry after "
        f"{wait_s:.2f}s",
        code=RATE_LIMIT_EXCEEDED,
    )
