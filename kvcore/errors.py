"""The error shape of every refusal, written once: one vocabulary, two dialects.

OpenAI's dialect, ``{"error": {"message", "type", "param", "code"}}``, is what the gateway,
the sidecar and the adapters answer; Anthropic's, ``{"type": "error", "error": {"type",
"message"}}``, is what the gateway answers on Anthropic's route (``/v1/messages``). The HTTP
status decides the ``type`` (``error_type``, ``anthropic_error_type``); what exactly went
wrong is the ``code``: a string naming it, or null, never a number. ``error_from_reply``
reads any error reply (ours, an engine's, a framework's bare 404) back into the vocabulary.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson

__all__ = [
    "BAD_GATEWAY",
    "ENDPOINT_NOT_SERVED",
    "ENDPOINT_REFUSED",
    "ENGINE_UNREACHABLE",
    "METHOD_NOT_ALLOWED",
    "MODEL_NOT_FOUND",
    "RATE_LIMIT_EXCEEDED",
    "SERVICE_UNAVAILABLE",
    "UNKNOWN_ENDPOINT",
    "UPSTREAM_TIMEOUT",
    "Dialect",
    "OpenAIError",
    "anthropic_error_type",
    "error_from_reply",
    "error_type",
    "route_missing",
]

# Codes (``error.code``) that clients and our own processes act on.
MODEL_NOT_FOUND = "model_not_found"
UNKNOWN_ENDPOINT = "unknown_endpoint"  # the gateway has no such route at all
ENDPOINT_NOT_SERVED = "endpoint_not_served"  # the gateway routes it; no worker serves it
ENDPOINT_REFUSED = "endpoint_refused_by_worker"  # this worker's engine has no such route
METHOD_NOT_ALLOWED = "method_not_allowed"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
SERVICE_UNAVAILABLE = "service_unavailable"  # no worker can take it now: retry (retry-after)
BAD_GATEWAY = "bad_gateway"
ENGINE_UNREACHABLE = "engine_unreachable"  # a sidecar is up, its engine is not
UPSTREAM_TIMEOUT = "upstream_timeout"

_HEAD = 300  # how much of an unreadable error reply is quoted


class Dialect(enum.Enum):
    """Whose error shape a route answers in."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status (the SDK raises by status; the type is
    the broad class, the ``code`` the specific reason)."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


# Every type here is one of the Anthropic SDK's ``ErrorObject`` variants.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    known = _ANTHROPIC_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


class OpenAIError(Exception):
    """A refusal: an HTTP status, a message that says what and why, and maybe the parameter
    at fault and a code naming the reason. Its ``type`` follows from the status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return error_type(self.status)

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_dict(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {"type": anthropic_error_type(self.status), "message": self.message},
        }

    def body(self, dialect: Dialect = Dialect.OPENAI) -> bytes:
        """The JSON body of the error reply, in ``dialect``."""
        if dialect is Dialect.ANTHROPIC:
            return orjson.dumps(self.anthropic_dict())
        return orjson.dumps(self.to_dict())


def route_missing(status: int, body: bytes) -> bool:
    """Whether ``body`` is a web framework's own answer for a route it does not have
    (aiohttp's ``404: Not Found``, Starlette's ``Not Found``, FastAPI's ``{"detail": "Not
    Found"}``, and their 405s), rather than the application's refusal (an unknown model)."""
    if status not in (404, 405):
        return False
    text = body.strip()
    if text.startswith(b"{"):
        try:
            parsed = orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(parsed, dict) or set(parsed) != {"detail"}:
            return False
        text = str(parsed["detail"]).encode()
    return text in (b"", b"Not Found", b"404: Not Found", b"Method Not Allowed",
                    b"405: Method Not Allowed")


def error_from_reply(
    status: int, body: bytes | str | dict[str, Any], source: str | None = None
) -> OpenAIError:
    """Any error reply (its known shapes, or plain text) in our vocabulary.

    Known shapes: ours and OpenAI's ``{"error": {"message", "param", "code"}}``,
    Anthropic's ``{"type": "error", "error": {"type", "message"}}``, ``{"error": "text"}``,
    ``{"object": "error", "message", "code"}`` (SGLang's, vLLM's and trtllm-serve's
    ``ErrorResponse``, whose numeric ``code`` repeats the status and is dropped), FastAPI's
    ``{"detail": ...}``; anything else is quoted. A server error's message is prefixed with
    ``source`` (who failed: "sglang engine"), when given.
    """
    parsed: Any = body
    if isinstance(body, bytes | str):
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message: str | None = None
    fields: dict[str, Any] = {}
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict):
            message, fields = _text(err.get("message")), err
        elif err is not None:
            message = _text(err)
        elif "message" in parsed:
            message, fields = _text(parsed.get("message")), parsed
        elif "detail" in parsed:
            message = _text(parsed["detail"])
    if not message:
        raw = parsed if isinstance(parsed, str) else orjson.dumps(parsed).decode()
        message = raw[:_HEAD] or f"empty error reply with status {status}"
    if status >= 500 and source is not None and not message.startswith(source):
        message = f"{source} error: {message}"
    code, param = fields.get("code"), fields.get("param")
    return OpenAIError(
        status,
        message,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) and code else None,
    )


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return orjson.dumps(value).decode()[:_HEAD]
