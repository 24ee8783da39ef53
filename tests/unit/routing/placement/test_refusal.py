"""Refusal: no placement, in the OpenAI error shape the client gets."""

from __future__ import annotations

from kvcore.errors import MODEL_NOT_FOUND, OpenAIError
from routing.placement.refusal import Refusal


def test_a_request_error_refused_keeps_its_body() -> None:
    """A request refused before placement answers the very body its error would."""
    error = OpenAIError(404, "model 'x' is not served", param="model", code=MODEL_NOT_FOUND)
    refusal = Refusal.of(error)
    assert (refusal.status, refusal.busy, refusal.retry_after_s) == (404, False, None)
    assert refusal.error().body() == error.body()


def test_a_refusal_without_a_code_says_null() -> None:
    """No code: the body's ``code`` is null, its type follows from the status."""
    body = Refusal(413, "request body exceeds 10 bytes", None).error().to_dict()["error"]
    assert (body["code"], body["type"], body["param"]) == (None, "invalid_request_error", None)
