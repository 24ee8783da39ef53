"""Request validation at the HTTP boundary: clear errors naming the bad field."""

from __future__ import annotations

import pytest

from refengine.protocol import BadRequest, parse_generate, parse_sampling
from refengine.tokenizer import DEFAULT_MODEL_PATH, ChatTokenizer

TOK = ChatTokenizer.from_model_path(DEFAULT_MODEL_PATH)


def test_text_and_ids_are_accepted() -> None:
    """text is tokenized; input_ids pass through; sampling params are parsed."""
    g = parse_generate(
        {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}, TOK
    )
    assert g.requests[0].prompt == TOK.encode("hello") and g.texts_given
    assert g.requests[0].params.greedy and g.requests[0].params.max_new_tokens == 3
    g = parse_generate({"input_ids": [[1, 2], [3]], "rid": ["a", "b"]}, TOK)
    assert g.batch and [r.rid for r in g.requests] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "Either text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "Either text or input_ids"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [1, "x"]}, "integers"),
        ({"input_ids": [10**9]}, "outside the vocabulary"),
        ({"text": "a", "bogus": 1}, "unknown fields"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "a", "sampling_params": {"wat": 1}}, "unknown sampling_params"),
        ({"text": ["a", "b"], "stream": True}, "streaming a batch"),
        ({"text": "a", "return_logprob": True}, "return_logprob"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_requests_name_the_problem(body: object, needle: str) -> None:
    """Each malformed body raises BadRequest with a message naming the field."""
    with pytest.raises(BadRequest, match=needle):
        parse_generate(body, TOK)


def test_sampling_defaults_match_sglang() -> None:
    """Defaults: 128 new tokens, temperature 1, top_p 1, top_k off."""
    sp = parse_sampling(None, 100)
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k) == (128, 1.0, 1.0, -1)
    assert parse_sampling({"stop": "x"}, 100).stop == ("x",)


def test_penalties_are_parsed_and_bounded() -> None:
    """SGLang's penalties are honoured (parsed, not ignored), within SGLang's ranges."""
    sp = parse_sampling(
        {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.5}, 100
    )
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.5)
    with pytest.raises(BadRequest, match="presence_penalty"):
        parse_sampling({"presence_penalty": 3}, 100)
    with pytest.raises(BadRequest, match="repetition_penalty"):
        parse_sampling({"repetition_penalty": 0}, 100)


def test_penalties_lower_the_logits_of_tokens_already_seen() -> None:
    """Frequency per occurrence and presence once over the output; repetition over prompt and
    output divides a positive logit and multiplies a negative one; unseen tokens keep theirs."""
    import torch

    from refengine.request import SamplingParams
    from refengine.torch_compute import penalize

    logits = torch.tensor([1.0, 2.0, -2.0, 4.0])
    out = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                   prompt=[0], output=[1, 1, 2])
    assert out.tolist() == [1.0, 2.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 4.0]
    out = penalize(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[2])
    assert out.tolist() == [0.5, 2.0, -4.0, 4.0]
    assert penalize(logits, SamplingParams(), [0], [1]) is logits  # neutral: untouched
