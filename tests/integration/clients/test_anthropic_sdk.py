"""The official anthropic SDK against a real gateway's ``/v1/messages``: messages and their
stream events validate in its models; refusals come in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest
from anthropic.types import ErrorResponse, Message, MessageParam, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.integration.clients.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

MESSAGES: list[MessageParam] = [{"role": "user", "content": "say something about caches"}]
EVENT: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module", params=["sidecar", "plain"])
def client(request: pytest.FixtureRequest, gateway_url: str,
           plain_gateway_url: str) -> Iterator[anthropic.Anthropic]:
    """A sync client of a gateway whose worker is the sidecar, or the engine itself; closed
    at the end (an open keep-alive socket left to the collector warns in a later test)."""
    url = gateway_url if request.param == "sidecar" else plain_gateway_url
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0) as client:
        yield client


def test_a_message_validates(client: anthropic.Anthropic) -> None:
    """A whole message, with a system prompt and a stop sequence, validates as ``Message``."""
    raw = client.messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=6, system="be brief", messages=MESSAGES,
        stop_sequences=["\n\n\n"])
    message = Message.model_validate(raw.http_response.json())
    assert message.role == "assistant" and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert message.usage.output_tokens >= 1


def test_a_stream_validates_event_by_event(client: anthropic.Anthropic) -> None:
    """Each raw event of a stream validates; the SDK's stream helper assembles the final
    message from the text deltas."""
    events = list(client.messages.create(model=MODEL_NAME, max_tokens=6, messages=MESSAGES,
                                         stream=True))
    for event in events:
        EVENT.validate_python(event.model_dump())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with client.messages.stream(model=MODEL_NAME, max_tokens=6,
                                messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens >= 1


async def test_async_message_and_stream(gateway_url: str) -> None:
    """The async client gets a whole message and a stream ending in ``message_stop``."""
    client = anthropic.AsyncAnthropic(base_url=gateway_url, api_key="none", max_retries=0)
    message = await client.messages.create(model=MODEL_NAME, max_tokens=4,
                                           messages=MESSAGES)
    Message.model_validate(message.model_dump())
    stream = await client.messages.create(model=MODEL_NAME, max_tokens=4,
                                          messages=MESSAGES, stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    await client.close()


def test_refusals_come_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    """The gateway's own refusal (an unknown model) and the engine's (no max_tokens... a
    content block it cannot take) are Anthropic error bodies the SDK maps to its classes."""
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-x", max_tokens=4,
                               messages=MESSAGES)
    assert ErrorResponse.model_validate(unknown.value.body).error.type == "not_found_error"
    assert "claude-x" in unknown.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://example.test/cat.png"}}]}])
    error = ErrorResponse.model_validate(bad.value.body).error
    assert error.type == "invalid_request_error" and "text content" in error.message
