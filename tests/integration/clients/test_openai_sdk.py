"""The official openai SDK against a real gateway: what it gets validates in its models, and
each refusal raises the class it documents, with a string ``code`` naming the reason."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from tests.integration.clients.conftest import MODEL_NAME, Stack
from tests.support.fake_openai import FakeEngine

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "say something about caches"}]


@pytest.fixture(scope="module")
def client(gateway_url: str) -> Iterator[openai.OpenAI]:
    """A sync client of the KV-aware gateway (no retries: each answer is seen as it is),
    closed at the end: an open keep-alive socket left to the collector warns in a later test."""
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0) as client:
        yield client


@pytest.fixture
async def aclient(gateway_url: str) -> openai.AsyncOpenAI:
    """An async client of the KV-aware gateway."""
    return openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)


def test_chat_whole_and_streamed_validate(client: openai.OpenAI) -> None:
    """A chat completion and its stream's chunks validate as the SDK's models."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    whole = ChatCompletion.model_validate(raw.http_response.json())
    assert whole.choices[0].message.role == "assistant" and whole.usage is not None
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


async def test_async_chat_whole_and_streamed(aclient: openai.AsyncOpenAI) -> None:
    """The async client gets the same: a whole completion and a stream ending in a reason."""
    whole = await aclient.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    ChatCompletion.model_validate(whole.model_dump())
    stream = await aclient.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, stream=True)
    reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert reasons[-1] in ("stop", "length")
    await aclient.close()


@pytest.mark.parametrize(
    "prompt",
    ["one prompt", ["one prompt in a list"], [5, 6, 7, 8], [[5, 6, 7, 8]]],
    ids=["text", "text-list-of-one", "token-ids", "token-list-of-one"],
)
def test_a_single_prompt_in_each_form_gets_one_choice(client: openai.OpenAI,
                                                      prompt: str | list) -> None:  # type: ignore[type-arg]
    """A prompt as text, token ids, or a list of one of either, gets one choice."""
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt,
                                                      max_tokens=3)
    completion = Completion.model_validate(raw.http_response.json())
    assert [c.index for c in completion.choices] == [0]


@pytest.mark.parametrize(
    "prompt",
    [["first prompt", "second prompt", "third"], [[5, 6, 7], [8, 9], [10, 11, 12, 13]]],
    ids=["texts", "token-lists"],
)
def test_a_batch_of_prompts_gets_one_choice_per_prompt(client: openai.OpenAI,
                                                       prompt: list) -> None:  # type: ignore[type-arg]
    """A batch of prompts (texts or token-id lists) gets one choice per prompt, in order."""
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3)
    Completion.model_validate(completion.model_dump())
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    assert completion.usage is not None and completion.usage.completion_tokens >= 3


def test_a_batch_with_n_is_prompt_major(client: openai.OpenAI) -> None:
    """With ``n``, choice ``i * n + j`` is sample ``j`` of prompt ``i``: same-length prompts'
    samples differ by prompt (usage counts each prompt once)."""
    one = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=2)
    completion = client.completions.create(
        model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9, 10, 11, 12]], max_tokens=2, n=2)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.usage is not None and one.usage is not None
    assert completion.usage.prompt_tokens == one.usage.prompt_tokens + 5


async def test_a_streamed_batch_carries_every_index(aclient: openai.AsyncOpenAI) -> None:
    """A streamed batch's chunks carry each choice's index, and each choice finishes."""
    stream = await aclient.completions.create(
        model=MODEL_NAME, prompt=["first prompt", "second prompt"], max_tokens=3, n=2,
        stream=True)
    finished = {c.index for chunk in [x async for x in stream] for c in chunk.choices
                if c.finish_reason}
    assert finished == {0, 1, 2, 3}
    await aclient.close()


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    """``models.list`` and ``models.retrieve`` give OpenAI's model object; an unknown model
    is NotFoundError ``model_not_found``."""
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL_NAME]
    model = client.models.retrieve(MODEL_NAME)
    Model.model_validate(model.model_dump())
    assert (model.id, model.object) == (MODEL_NAME, "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_refusals_raise_the_documented_classes(client: openai.OpenAI) -> None:
    """A bad parameter is BadRequestError naming it; an unknown model NotFoundError
    ``model_not_found``; every code and type a string."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                       temperature=5)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert unknown.value.code == "model_not_found"
    assert unknown.value.type == "invalid_request_error"


@pytest.mark.parametrize("which", ["sidecar", "plain"])
def test_a_route_no_worker_serves_says_so(which: str, gateway_url: str, plain_gateway_url: str,
                                          request: pytest.FixtureRequest) -> None:
    """Embeddings and responses, which the engine does not serve, are NotFoundError
    ``endpoint_not_served`` naming the route and the worker (not an unknown model), through
    a sidecar or straight to the engine."""
    url = gateway_url if which == "sidecar" else plain_gateway_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    request.addfinalizer(client.close)
    with pytest.raises(openai.NotFoundError) as embeddings:
        client.embeddings.create(model=MODEL_NAME, input="a text")
    assert embeddings.value.code == "endpoint_not_served"
    assert "/v1/embeddings" in embeddings.value.message
    with pytest.raises(openai.NotFoundError) as responses:
        client.responses.create(model=MODEL_NAME, input="a text")
    assert responses.value.code == "endpoint_not_served"
    assert "/v1/responses" in responses.value.message
    workers = client.get("/workers", cast_to=object)
    refused = workers["workers"][0]["refused_endpoints"]  # type: ignore[index]
    assert refused == ["/v1/embeddings", "/v1/responses"]


@pytest.fixture
def embedding_engine() -> Iterator[str]:
    """An OpenAI engine that serves the relayed routes (the gateway suite's fake engine)."""
    with FakeEngine(MODEL_NAME).start() as engine:
        yield engine.url


def test_a_route_one_worker_lacks_is_served_by_another(
        stack: Stack, embedding_engine: str, request: pytest.FixtureRequest) -> None:
    """In a fleet where one engine serves embeddings and one does not, every embeddings
    request is served: a refusal sends it on to the other worker, and the refusing worker is
    then passed over (``refused_endpoints``)."""
    gateway = stack.gateway("gateway-mixed", "--worker", stack.engine_url,
                            "--worker", embedding_engine, "--router-mode", "round-robin")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    request.addfinalizer(client.close)
    for _ in range(4):
        raw = client.embeddings.with_raw_response.create(model=MODEL_NAME, input="a text")
        assert raw.http_response.status_code == 200
        assert raw.headers["x-kvsidecar-worker"] == embedding_engine
    workers = client.get("/workers", cast_to=object)["workers"]  # type: ignore[index]
    assert {w["url"]: w["refused_endpoints"] for w in workers} == {
        stack.engine_url: ["/v1/embeddings"], embedding_engine: []}


def test_an_unknown_path_is_unknown_endpoint(client: openai.OpenAI) -> None:
    """A path the gateway has no route for is NotFoundError ``unknown_endpoint``."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.post("/audio/speech", body={"model": MODEL_NAME}, cast_to=object)
    assert caught.value.code == "unknown_endpoint"
    assert "POST /v1/audio/speech" in caught.value.message
