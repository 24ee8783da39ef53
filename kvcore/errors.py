"""The OpenAI error shape, written once: ``{"error": {"message", "type", "param", "code"}}``.

The gateway answers bad requests with it, the sidecar answers engine failures with it, and
the adapters turn each engine's own error replies into it, so a client sees one shape
whichever process refused its request.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["OpenAIError"]


class OpenAIError(Exception):
    """A refusal with an HTTP status and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        """The JSON body of the error reply."""
        return orjson.dumps(self.to_dict())
