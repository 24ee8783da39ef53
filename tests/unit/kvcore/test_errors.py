"""The error vocabulary (``kvcore.errors``): one shape per dialect, read by the official SDKs
as they document it, and any engine's error reply read back into it."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest
from anthropic.types import ErrorResponse

from kvcore.errors import (
    ENDPOINT_NOT_SERVED,
    Dialect,
    OpenAIError,
    anthropic_error_type,
    error_from_reply,
    error_type,
    route_missing,
)

# Every status the gateway (or a sidecar through it) answers, and the SDKs' classes for it.
OPENAI_CLASSES: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    403: openai.PermissionDeniedError,
    404: openai.NotFoundError,
    405: openai.APIStatusError,
    409: openai.ConflictError,
    413: openai.APIStatusError,
    422: openai.UnprocessableEntityError,
    429: openai.RateLimitError,
    500: openai.InternalServerError,
    501: openai.InternalServerError,
    502: openai.InternalServerError,
    503: openai.InternalServerError,
    504: openai.InternalServerError,
}
ANTHROPIC_CLASSES: dict[int, type[anthropic.APIStatusError]] = {
    400: anthropic.BadRequestError,
    401: anthropic.AuthenticationError,
    403: anthropic.PermissionDeniedError,
    404: anthropic.NotFoundError,
    405: anthropic.APIStatusError,
    409: anthropic.ConflictError,
    413: anthropic.ContentTooLargeError,
    422: anthropic.UnprocessableEntityError,
    429: anthropic.RateLimitError,
    500: anthropic.InternalServerError,
    501: anthropic.HTTPNotImplementedError,
    502: anthropic.InternalServerError,
    503: anthropic.ServiceUnavailableError,
    504: anthropic.GatewayTimeoutError,
}


@pytest.mark.parametrize("status", sorted(OPENAI_CLASSES))
def test_the_openai_sdk_raises_its_class_with_string_code_and_type(status: int) -> None:
    """For each status, the openai SDK raises its documented class, with ``code``, ``type``
    and ``param`` as strings."""
    error = OpenAIError(status, f"refused with {status}", param="model", code="some_reason")

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=error.body(),
                              headers={"content-type": "application/json"})

    with openai.OpenAI(
        base_url="http://gateway.test/v1", api_key="k", max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(reply)),
    ) as client, pytest.raises(openai.APIStatusError) as caught:
        client.models.list()
    exc = caught.value
    assert type(exc) is OPENAI_CLASSES[status]
    assert exc.status_code == status and exc.code == "some_reason" and exc.param == "model"
    assert isinstance(exc.type, str) and exc.type == error_type(status)
    assert f"refused with {status}" in exc.message


def test_a_refusal_without_a_code_gives_the_sdk_none() -> None:
    """``code`` is null when nothing more specific than the status is known."""
    body = orjson.loads(OpenAIError(400, "bad").body())
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                              "code": None}}


@pytest.mark.parametrize("status", sorted(ANTHROPIC_CLASSES))
def test_the_anthropic_sdk_raises_its_class_and_the_body_validates(status: int) -> None:
    """In Anthropic's dialect, the anthropic SDK raises its class for each status and the
    body validates as its ``ErrorResponse``."""
    error = OpenAIError(status, f"refused with {status}", code="some_reason")

    def reply(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, content=error.body(Dialect.ANTHROPIC),
                               headers={"content-type": "application/json"})

    with anthropic.Anthropic(
        base_url="http://gateway.test", api_key="k", max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(reply)),
    ) as client, pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="m", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    exc = caught.value
    assert type(exc) is ANTHROPIC_CLASSES[status] and exc.status_code == status
    parsed = ErrorResponse.model_validate(exc.body)
    assert parsed.error.type == anthropic_error_type(status)
    assert parsed.error.message == f"refused with {status}"


@pytest.mark.parametrize(
    ("status", "body", "message", "code"),
    [
        (400, {"error": {"message": "bad", "code": "invalid_value", "param": "n"}}, "bad",
         "invalid_value"),
        (400, {"object": "error", "message": "too long", "type": "BadRequestError",
               "code": 400}, "too long", None),
        (404, {"type": "error", "error": {"type": "not_found_error", "message": "gone"}},
         "gone", None),
        (429, {"error": "slow down"}, "slow down", None),
        (422, {"detail": [{"loc": ["body", "x"]}]}, '[{"loc":["body","x"]}]', None),
        (502, b"<html>bad gateway</html>", "vllm engine error: <html>bad gateway</html>", None),
        (500, b"", "vllm engine error: empty error reply with status 500", None),
    ],
)
def test_error_replies_of_every_known_shape_are_read_into_the_vocabulary(
    status: int, body: Any, message: str, code: str | None
) -> None:
    """OpenAI's, SGLang's/vLLM's ``ErrorResponse`` (numeric code dropped), Anthropic's,
    FastAPI's and plain-text error replies keep their message; the type follows the status."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    error = error_from_reply(status, raw, "vllm engine")
    assert (error.status, error.message, error.code) == (status, message, code)
    assert error.to_dict()["error"]["type"] == error_type(status)


def test_the_type_follows_the_status() -> None:
    """One type per class of status, in each dialect."""
    assert [error_type(s) for s in (400, 401, 403, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error",
        "invalid_request_error", "invalid_request_error", "rate_limit_error", "server_error",
        "server_error"]
    assert [anthropic_error_type(s) for s in (400, 404, 429, 500, 503, 504)] == [
        "invalid_request_error", "not_found_error", "rate_limit_error", "api_error",
        "overloaded_error", "timeout_error"]


@pytest.mark.parametrize(
    ("status", "body", "missing"),
    [
        (404, b"404: Not Found", True),  # aiohttp
        (404, b'{"detail":"Not Found"}', True),  # FastAPI
        (404, b"Not Found", True),  # Starlette
        (405, b"405: Method Not Allowed", True),
        (404, OpenAIError(404, "the model 'x' does not exist").body(), False),
        (404, b'{"detail":"model x not found"}', False),
        (400, b"404: Not Found", False),
    ],
)
def test_a_framework_404_is_told_from_an_applications(
    status: int, body: bytes, missing: bool
) -> None:
    """A web framework's bare answer for a missing route is a missing route; an application's
    404 (an unknown model) is not."""
    assert route_missing(status, body) is missing


def test_anthropic_shape_carries_type_and_message_only() -> None:
    """Anthropic's body has no code: the message says it all."""
    body = orjson.loads(OpenAIError(404, "no worker serves POST /v1/messages",
                                    code=ENDPOINT_NOT_SERVED).body(Dialect.ANTHROPIC))
    assert body == {"type": "error", "error": {"type": "not_found_error",
                                               "message": "no worker serves POST /v1/messages"}}
